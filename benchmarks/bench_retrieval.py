"""Our vector indexes against FAISS on the same vectors (recall@10, queries per second), then a small LM's
held-out perplexity with and without kNN-LM retrieval.

    python benchmarks/bench_retrieval.py                          # 100k vectors, d=64, 1000 queries
    python benchmarks/bench_retrieval.py --n 20000 --threads 2
    python benchmarks/bench_retrieval.py --no-lm                  # the indexes only, no kNN-LM section

The vectors are ``llmedu.retrieval.clustered_vectors`` (clustered, low intrinsic dimension, unit
norm: shaped like real embeddings); the queries are a held-out draw from the same distribution.
For each kind of index (exact IP, IVF-Flat, IVF-PQ) both libraries are built with the same settings
(nlist, M, nbits; an L2 coarse quantizer; inner-product scores), then searched ``--repeats`` times;
the table gives min and median seconds, queries/s from the median, recall@10 against exact search,
and the bytes the index stores. Both run on ``--threads`` threads (torch and OpenMP). Claims
checked: exact search returns FAISS's ids (the same set; only near-ties, equal to
rounding, may come in another order); IVF and IVF-PQ recall are comparable (ours within 0.05
of FAISS's). FAISS is faster for IVF and IVF-PQ (C++ loops, SIMD kernels, where ours loops over lists in
Python); exact search is one matrix product in both, about equally fast. The ratio column says how much.

Then (unless ``--no-lm``) the same question asked of a language model, as in lesson 24 §3: a small byte-level
GPT (d_model 64, 2 layers; seeded) is trained ``--lm-steps`` steps on chunk pairs [c_i, c_(i+1)] of the KJV
training books (``rag.train_on_examples``, loss on the second chunk); its final hidden states for ``--lm-rows``
training pairs are a kNN-LM datastore (``knn_lm.build_datastore``, one key per scored byte, exact L2 search).
On ``--lm-eval`` held-out pairs of the validation books it prints loss (nats/byte) and perplexity (e^loss)
for the unigram baseline (add-one counts of the training bytes), the LM alone (``knowledge.lm_loss``), and the
LM + kNN-LM at the lesson's lambda 0.25 (``knowledge.knn_lm_losses``; its lambda-0 value must equal the LM
alone's, a check). The search of the held-out queries is timed for our FlatIndex and FAISS IndexFlatL2.
A briefly trained model, not the lesson's full run: the numbers say that retrieval helps and by how much at
this size, not what a well-trained LM would gain (Khandelwal et al. 2020 report the gain growing with the store).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import faiss
import torch

from llmedu.data import load_documents
from llmedu.models import CausalLM, TransformerConfig
from llmedu.retrieval import FlatIndex, IVFIndex, clustered_vectors, recall_at_k
from llmedu.retrieval.datastore import chunk_pairs
from llmedu.retrieval.knn_lm import build_datastore
from llmedu.retrieval.knowledge import knn_lm_losses, lm_loss
from llmedu.retrieval.rag import train_on_examples


def timed(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def lm_section(a) -> dict:
    """Held-out loss and perplexity of a small LM alone, with kNN-LM retrieval, and of the unigram baseline."""
    m = 32  # bytes per chunk: rows are [c_i, c_(i+1)], the second chunk scored (lesson 24's M_CHUNK)
    t0 = time.perf_counter()
    train_rows, _ = chunk_pairs(load_documents("kjv", "train"), m)  # (n, 2m)
    train_rows = train_rows[torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(0))]
    val_rows, _ = chunk_pairs(load_documents("kjv", "validation"), m)
    keep = torch.randperm(len(val_rows), generator=torch.Generator().manual_seed(1))[: a.lm_eval].sort().values
    val_rows = val_rows[keep]  # (n_eval, 2m): held-out books, never trained on, never in the datastore
    if a.lm_rows > len(train_rows):
        raise ValueError(f"--lm-rows {a.lm_rows} exceeds the {len(train_rows)} chunk pairs of the training books")

    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.gpt2(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=256))
    train_on_examples(model, train_rows, m, a.lm_steps, batch=a.lm_batch, lr=3e-3, seed=0)
    train_s = time.perf_counter() - t0
    model.eval()

    t0 = time.perf_counter()
    keys, values = build_datastore(model, train_rows[: a.lm_rows], last=m)  # (N, d), (N,): one per scored byte
    index = FlatIndex(keys.shape[1], metric="l2", block=64)
    index.add(keys)
    datastore_s = time.perf_counter() - t0

    counts = torch.bincount(train_rows[:, m:].flatten(), minlength=256).float() + 1  # add-one unigram counts
    unigram = -(counts / counts.sum()).log()[val_rows[:, m:]].mean().item()
    alone = lm_loss(model, val_rows, m)
    t0 = time.perf_counter()
    at_zero, with_knn = knn_lm_losses(model, index, values, val_rows, m, [0.0, a.lam], k=a.knn_k)
    eval_s = time.perf_counter() - t0

    # the search alone: the held-out queries (the hidden states kNN-LM looks up) against our index and FAISS's
    queries, _ = build_datastore(model, val_rows, last=m)  # (n_eval * m, d)
    ref = faiss.IndexFlatL2(keys.shape[1])
    ref.add(keys.numpy())
    ours_t, _ = timed(lambda: index.search(queries, a.knn_k), a.repeats)
    faiss_t, _ = timed(lambda: ref.search(queries.numpy(), a.knn_k), a.repeats)

    losses = {"unigram": unigram, "LM alone": alone, f"LM + kNN-LM (lambda {a.lam:g})": with_knn}
    print(
        f"\nkNN-LM: byte GPT of {sum(p.numel() for p in model.parameters()):,} parameters, {a.lm_steps} steps of "
        f"{a.lm_batch} chunk pairs ({train_s:.0f} s with data loading); datastore {len(keys)} keys of {keys.shape[1]} "
        f"floats from {a.lm_rows} training pairs ({datastore_s:.1f} s); held-out: {len(val_rows) * m} scored bytes "
        f"of the validation books, k={a.knn_k} exact neighbours ({eval_s:.1f} s)"
    )
    print(f"{'model':26} {'loss nats/byte':>15} {'perplexity':>11} {'vs LM alone':>12}")
    for name, loss in losses.items():
        print(f"{name:26} {loss:15.4f} {math.exp(loss):11.3f} {loss - alone:+12.4f}")
    gap = abs(at_zero - alone)
    print(f"check: kNN-LM at lambda 0 equals the LM alone within {gap:.1e} nats/byte (<= 1e-5: {gap <= 1e-5})")
    per_q = {lib: statistics.median(t) / len(queries) for lib, t in (("ours", ours_t), ("faiss", faiss_t))}
    print(
        f"search of {len(queries)} queries, k={a.knn_k}, {len(keys)} keys (median of {a.repeats}): ours "
        f"{per_q['ours'] * 1e6:.1f} us/query (min {min(ours_t) / len(queries) * 1e6:.1f}), FAISS IndexFlatL2 "
        f"{per_q['faiss'] * 1e6:.1f} us/query (min {min(faiss_t) / len(queries) * 1e6:.1f}); "
        f"faiss/ours speed {per_q['ours'] / per_q['faiss']:.1f}x"
    )
    return dict(
        parameters=sum(p.numel() for p in model.parameters()),
        train_steps=a.lm_steps,
        datastore_keys=len(keys),
        eval_bytes=len(val_rows) * m,
        lam=a.lam,
        k=a.knn_k,
        loss_unigram=unigram,
        loss_lm=alone,
        loss_knn_lm=with_knn,
        ppl_unigram=math.exp(unigram),
        ppl_lm=math.exp(alone),
        ppl_knn_lm=math.exp(with_knn),
        lambda0_gap=gap,
        search_us_per_query_ours=per_q["ours"] * 1e6,
        search_us_per_query_faiss=per_q["faiss"] * 1e6,
        train_s=train_s,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--nlist", type=int, default=256)
    ap.add_argument("--nprobe", type=int, default=8)
    ap.add_argument("--M", type=int, default=16)
    ap.add_argument("--nbits", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-lm", action="store_true", help="skip the kNN-LM perplexity section")
    ap.add_argument("--lm-steps", type=int, default=300, help="training steps of the small LM")
    ap.add_argument("--lm-batch", type=int, default=16)
    ap.add_argument("--lm-rows", type=int, default=4096, help="training chunk pairs in the datastore (32 keys each)")
    ap.add_argument("--lm-eval", type=int, default=200, help="held-out chunk pairs (32 scored bytes each)")
    ap.add_argument("--lam", type=float, default=0.25, help="kNN-LM lambda (lesson 24's, fixed before any run)")
    ap.add_argument("--knn-k", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    faiss.omp_set_num_threads(a.threads)

    x = clustered_vectors(a.n, a.d, n_clusters=500, rank=16)
    q = clustered_vectors(a.queries, a.d, n_clusters=500, rank=16, seed=1)
    xn, qn = x.numpy(), q.numpy()
    print(
        f"{a.n} vectors, d={a.d}, {a.queries} queries, {a.threads} thread(s); nlist={a.nlist}, nprobe={a.nprobe}, "
        f"PQ M={a.M} x {a.nbits} bits"
    )

    rows, true = [], None
    for kind in ("exact", "ivf_flat", "ivf_pq"):
        for lib in ("ours", "faiss"):
            t0 = time.perf_counter()
            if lib == "ours":
                index = (
                    FlatIndex(a.d)
                    if kind == "exact"
                    else IVFIndex(a.d, a.nlist, pq_M=a.M if kind == "ivf_pq" else None, pq_nbits=a.nbits)
                )
                if kind != "exact":
                    index.train(x)
                index.add(x)
                search = lambda: index.search(q, 10, **({} if kind == "exact" else {"nprobe": a.nprobe}))[1]  # noqa: E731
                nbytes = index.nbytes()
            else:
                if kind == "exact":
                    index = faiss.IndexFlatIP(a.d)
                elif kind == "ivf_flat":
                    index = faiss.IndexIVFFlat(faiss.IndexFlatL2(a.d), a.d, a.nlist, faiss.METRIC_INNER_PRODUCT)
                else:
                    index = faiss.IndexIVFPQ(
                        faiss.IndexFlatL2(a.d), a.d, a.nlist, a.M, a.nbits, faiss.METRIC_INNER_PRODUCT
                    )
                if kind != "exact":
                    index.train(xn)
                    index.nprobe = a.nprobe
                index.add(xn)
                search = lambda: torch.from_numpy(index.search(qn, 10)[1])  # noqa: E731
                nbytes = a.n * (a.d * 4 if kind != "ivf_pq" else a.M * a.nbits // 8)  # the stored vectors or codes
            build = time.perf_counter() - t0
            times, ids = timed(search, a.repeats)
            if kind == "exact" and lib == "ours":
                true = ids
            rows.append(
                dict(
                    kind=kind,
                    lib=lib,
                    build_s=build,
                    min_s=min(times),
                    median_s=statistics.median(times),
                    qps=a.queries / statistics.median(times),
                    recall10=recall_at_k(ids, true),
                    bytes=nbytes,
                    same_ids_as_ours=(ids == true).float().mean().item() if kind == "exact" else None,
                )
            )

    print(
        f"{'index':9} {'lib':6} {'build s':>8} {'min s':>8} {'median s':>9} {'queries/s':>10} {'faiss/ours':>11} {'recall@10':>10} {'MB':>7}"
    )
    for r in rows:
        ref = next(s for s in rows if s["kind"] == r["kind"] and s["lib"] == "ours")
        print(
            f"{r['kind']:9} {r['lib']:6} {r['build_s']:8.2f} {r['min_s']:8.3f} {r['median_s']:9.3f} {r['qps']:10.0f} "
            f"{r['qps'] / ref['qps']:10.1f}x {r['recall10']:10.3f} {r['bytes'] / 1e6:7.1f}"
        )
    exact_faiss = next(r for r in rows if r["kind"] == "exact" and r["lib"] == "faiss")
    ours_s = FlatIndex(a.d)
    ours_s.add(x)
    ref_s = faiss.IndexFlatIP(a.d)
    ref_s.add(xn)
    gap = (ours_s.search(q, 10)[0] - torch.from_numpy(ref_s.search(qn, 10)[0])).abs().max().item()
    exact_faiss["max_score_gap"] = gap
    print(
        f"exact search: FAISS IndexFlatIP's ids equal ours in {exact_faiss['same_ids_as_ours']:.2%} of the slots, "
        f"recall@10 {exact_faiss['recall10']:.4f}; the k-th best scores differ by at most {gap:.1e} slot by slot, "
        "so a differing id is a near-tie that rounding ordered differently"
    )
    for kind in ("ivf_flat", "ivf_pq"):
        ours, ref = (next(r for r in rows if r["kind"] == kind and r["lib"] == lib) for lib in ("ours", "faiss"))
        gap = ours["recall10"] - ref["recall10"]
        print(
            f"{kind}: recall@10 ours {ours['recall10']:.3f} vs FAISS {ref['recall10']:.3f} ({gap:+.3f}); "
            f"comparable (|gap| <= 0.05): {abs(gap) <= 0.05}"
        )
    lm = None if a.no_lm else lm_section(a)
    print(json.dumps({"config": vars(a), "rows": rows, "lm": lm}))


if __name__ == "__main__":
    main()
