"""How fast is our BPE? Training on ~5 MB of real text, against a naive trainer and against Rust.

    python benchmarks/bench_tokenizers.py                 # ~5 MB, vocabulary 8,000, 3 repeats
    python benchmarks/bench_tokenizers.py --megabytes 1 --vocab-size 4000 --naive-merges 200 --repeats 1   # quick

Claims checked (all from this one run, on this machine):

* training: our incremental BPE (``llmedu.tokenizers.BPETokenizer``) against the textbook trainer that
  recounts every pair before each merge, both timed over the same first K merges (pre-tokenisation
  included in both), and our full 8k training against Hugging Face ``tokenizers``' Rust BpeTrainer;
* encoding: GPT-2's vocabulary through ours, ``transformers``' GPT2TokenizerFast and tiktoken.

Each time is the min and the median of ``--repeats`` runs. The last line printed is JSON with the
key figures. Nothing is extrapolated unless a row says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import regex

from llmedu.data import load_corpus, reference_files
from llmedu.tokenizers import BPETokenizer
from llmedu.tokenizers.bpe import GPT2_PATTERN, bytes_to_unicode
from llmedu.tokenizers.pairs import merge_pair


def naive_bpe(text: str, vocab_size: int) -> list[tuple[int, int]]:
    """The textbook trainer: before each merge, recount every adjacent pair of every distinct chunk."""
    chunks = Counter(regex.findall(GPT2_PATTERN, text))
    words = {tuple(c.encode("utf-8")): n for c, n in chunks.items()}
    merges = []
    for new_id in range(256, vocab_size):
        counts: Counter = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] += n
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        words = {tuple(merge_pair(list(w), pair, new_id)): n for w, n in words.items()}
    return merges


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(min, median) seconds over ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def hf_bpe(text: str, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=5.0, help="training text, from Shakespeare then Wikipedia")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--naive-merges", type=int, default=1000, help="K: merges timed for the naive comparison")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--encode-megabytes", type=float, default=1.0)
    args = parser.parse_args(argv)

    pool = load_corpus("shakespeare") + "\n\n" + load_corpus("wikipedia") + "\n\n" + load_corpus("kjv")
    text = pool[: int(args.megabytes * 1e6)]
    held_out = load_corpus("wikipedia", "validation") + "\n\n" + load_corpus("shakespeare", "validation")
    held_out = held_out[: int(args.encode_megabytes * 1e6)]
    K, V, R = args.naive_merges, args.vocab_size, args.repeats
    print(
        f"training text: {len(text.encode()) / 1e6:.2f} MB ({len(text.split()):,} words); vocabulary {V:,}; "
        f"{R} repeats; python {sys.version.split()[0]}",
        flush=True,
    )

    rows = []  # (what, min s, median s, note)
    setup = timed(lambda: BPETokenizer().train(text, 257), R)  # pre-tokenise and count pairs, no merge
    rows.append(("ours, setup only (0 merges)", *setup[:2], "regex pre-tokenisation + first pair count"))
    ours_k = timed(lambda: BPETokenizer().train(text, 256 + K + 1), R)
    naive_k = timed(lambda: naive_bpe(text, 256 + K), min(R, 2))  # the slow one: at most 2 runs
    assert list(ours_k[2].merges) == naive_k[2], "the two trainers disagree on the first merges"
    rows += [
        (f"ours, first {K} merges", *ours_k[:2], "incremental pair counts + heap"),
        (f"naive recount, first {K} merges", *naive_k[:2], "recount all pairs before each merge"),
    ]
    ours_full = timed(lambda: BPETokenizer().train(text, V), R)
    hf_full = timed(lambda: hf_bpe(text, V), R)
    rows += [(f"ours, full {V:,}", *ours_full[:2], ""), (f"HF tokenizers (Rust), full {V:,}", *hf_full[:2], "")]
    ours_per_merge = max(ours_k[0] - setup[0], 1e-9) / K
    naive_per_merge = (naive_k[0] - setup[0]) / K  # the naive trainer's cost per merge, beyond the shared setup
    naive_full_estimate = setup[0] + naive_per_merge * (V - 257)
    rows.append(
        (
            f"naive recount, full {V:,}",
            naive_full_estimate,
            naive_full_estimate,
            f"EXTRAPOLATED: setup + {V - 257} x measured cost per merge",
        )
    )

    ours_ratio_tokens = len(ours_full[2].encode(held_out)) / len(hf_full[2].encode(held_out).ids)

    # Encoding throughput with GPT-2's vocabulary (a fresh tokenizer each repeat: no warm chunk cache).
    files = reference_files("gpt2")
    import tiktoken
    from transformers import GPT2TokenizerFast

    hf_gpt2 = GPT2TokenizerFast.from_pretrained(files["vocab.json"].parent)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    encoder = json.loads(files["encoder.json"].read_text(encoding="utf-8"))
    enc = tiktoken.Encoding(
        "gpt2-local",
        pat_str=GPT2_PATTERN,
        special_tokens={"<|endoftext|>": 50256},
        mergeable_ranks={bytes(byte_of[c] for c in t): i for t, i in encoder.items() if t != "<|endoftext|>"},
    )
    gpt2 = BPETokenizer.from_gpt2(files["encoder.json"], files["vocab.bpe"])

    def ours_encode():
        gpt2._cache.clear()
        return gpt2.encode(held_out)

    mb = len(held_out.encode()) / 1e6
    enc_ours = timed(ours_encode, R)
    enc_hf = timed(lambda: hf_gpt2(held_out)["input_ids"], R)
    enc_tt = timed(lambda: enc.encode(held_out, allowed_special="all"), R)
    assert enc_ours[2] == enc_hf[2] == enc_tt[2], "the three GPT-2 encoders disagree"

    print(f"\n{'training':<40}{'min s':>10}{'median s':>10}  note")
    for what, lo, med, note in rows:
        print(f"{what:<40}{lo:>10.2f}{med:>10.2f}  {note}")
    speedup_k = naive_k[0] / ours_k[0]
    print(f"\nours vs naive, first {K} merges (measured): {speedup_k:.1f}x faster")
    print(
        f"cost per merge beyond the setup: ours {ours_per_merge * 1e3:.2f} ms, naive {naive_per_merge * 1e3:.1f} ms "
        f"({naive_per_merge / ours_per_merge:.0f}x)"
    )
    print(f"ours vs naive, full {V:,} (naive extrapolated): {naive_full_estimate / ours_full[0]:.0f}x faster")
    print(f"HF Rust vs ours, full {V:,} (measured): ours is {ours_full[0] / hf_full[0]:.1f}x slower")
    print(f"held-out tokens, ours / HF at {V:,}: {ours_ratio_tokens:.4f}")
    print(f"\n{'encoding GPT-2, ' + f'{mb:.2f} MB':<40}{'min s':>10}{'median s':>10}{'MB/s (min)':>12}")
    for what, (lo, med, _) in [
        ("ours (pure Python)", enc_ours),
        ("transformers GPT2TokenizerFast", enc_hf),
        ("tiktoken", enc_tt),
    ]:
        print(f"{what:<40}{lo:>10.3f}{med:>10.3f}{mb / lo:>12.2f}")
    print(
        json.dumps(
            {
                "train_mb": round(len(text.encode()) / 1e6, 3),
                "vocab_size": V,
                "repeats": R,
                "naive_merges_timed": K,
                "ours_first_k_s": round(ours_k[0], 3),
                "naive_first_k_s": round(naive_k[0], 3),
                "speedup_vs_naive_first_k": round(speedup_k, 1),
                "setup_s": round(setup[0], 3),
                "ms_per_merge_ours": round(ours_per_merge * 1e3, 3),
                "ms_per_merge_naive": round(naive_per_merge * 1e3, 2),
                "ours_full_s": round(ours_full[0], 3),
                "hf_full_s": round(hf_full[0], 3),
                "ours_over_hf_time": round(ours_full[0] / hf_full[0], 2),
                "naive_full_extrapolated_s": round(naive_full_estimate, 1),
                "speedup_vs_naive_full_extrapolated": round(naive_full_estimate / ours_full[0], 1),
                "heldout_tokens_ours_over_hf": round(ours_ratio_tokens, 4),
                "encode_mb_per_s": {
                    "ours": round(mb / enc_ours[0], 3),
                    "transformers": round(mb / enc_hf[0], 3),
                    "tiktoken": round(mb / enc_tt[0], 3),
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
