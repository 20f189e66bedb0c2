"""Graders for the tensor-parallel lesson (12): what a step sends, what it can hide, what a rank holds.

The lesson's exercises:

check_exposed_per_block(fn)    fn(tokens, d_model, d_ff, n, flops, alpha, beta, bytes_per_value) -> (forward,
                               backward): seconds of one GPT block's all-reduces that no compute hides, when
                               f's all-reduce runs during the weight gradient of the column-split layers after
                               it (Megatron-LM) and g's waits; worked out by hand, not by calling llmedu
check_sp_column_backward(fn)   fn(x_shard, weight, grad_y, comm) -> (grad_x_shard, grad_w): the backward of
                               a sequence-parallel column-split layer, its all-gather hidden behind the input
                               gradient and its reduce-scatter behind the weight gradient (the order is checked)
check_bytes_per_rank(fn)       fn(d_model, n_layers, n_heads, vocab_size, seq_len, micro_batch, t) -> bytes one
                               rank holds training a GPT-2-style model (d_ff = 4 d_model, tied vocabulary-split
                               embedding) with mixed-precision Adam (16 bytes a parameter) and bf16 activations
                               with dropout (Korthikanti et al. 2022, table 2); not by calling llmedu

Earlier exercises, kept for their tests:

check_tp_step_all_reduces(fn)  fn(n_layers) -> (forward, backward): the all-reduce calls of one training
                               step of ``tensor_parallel(CausalLM(gpt2 config))`` with
                               ``vocab_parallel_lm_loss``: the blocks, the vocabulary-parallel embedding,
                               the tied column-parallel head and the loss
check_tp_params_per_rank(fn)   fn(d_model, d_ff, n_heads, n_kv_heads, n) -> parameters one rank holds of
                               one block's attention and MLP (biases on, as GPT-2): split weights and
                               biases are 1/n, the row-parallel layers' biases are whole on every rank
check_tp_step_time(fn)         fn(compute_s, n, n_layers, tokens, d_model, bytes_per_value, alpha, bandwidth)
                               -> the predicted seconds of the blocks' forward and backward on n ranks:
                               the one-rank compute split n ways, plus 4 ring all-reduces of
                               (tokens, d_model) per layer, none overlapped (the synchronous f and g)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .core import CheckResult, Grader, call_watching

__all__ = [
    "check_exposed_per_block",
    "check_sp_column_backward",
    "check_bytes_per_rank",
    "check_tp_step_all_reduces",
    "check_tp_params_per_rank",
    "check_tp_step_time",
]

LLMEDU = Path(__file__).resolve().parent.parent
GRADING = LLMEDU / "checks" / "core.py"  # the Grader itself, which runs the learner's function


def tp_step_all_reduces(n_layers: int) -> tuple[int, int]:
    """The reference. Forward: g in the embedding, g after attention and MLP, three in the loss
    (max, sum of exponentials, target logit). Backward: f before attention and MLP, f before the head."""
    return 1 + 2 * n_layers + 3, 2 * n_layers + 1


def tp_params_per_rank(d_model: int, d_ff: int, n_heads: int, n_kv_heads: int, n: int) -> int:
    """The reference: Q, K, V and up split by output features (weights and biases), o and down by input
    features (weights only; their biases are added once, after g, so each rank holds them whole)."""
    kv = d_model // n_heads * n_kv_heads  # key/value features
    attention = (d_model * (d_model + 2 * kv) + d_model + 2 * kv) // n + d_model * d_model // n + d_model
    mlp = (d_model * d_ff + d_ff) // n + d_ff * d_model // n + d_model
    return attention + mlp


def tp_step_time(compute_s, n, n_layers, tokens, d_model, bytes_per_value, alpha, bandwidth) -> float:
    """The reference: compute / n + 4 L ring all-reduces of tokens x d_model values (alpha-beta)."""
    if n == 1:
        return compute_s
    size = tokens * d_model * bytes_per_value
    one = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bandwidth
    return compute_s / n + 4 * n_layers * one


def check_tp_step_all_reduces(fn: Callable[[int], tuple]) -> CheckResult:
    g = Grader("check_tp_step_all_reduces")
    for n_layers in (1, 2, 12, 48):
        got = g.call(fn, n_layers)
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        g.compare(f"n_layers={n_layers}: (forward, backward)", got, tp_step_all_reduces(n_layers))
    return g.result()


def check_tp_params_per_rank(fn: Callable) -> CheckResult:
    g = Grader("check_tp_params_per_rank")
    for args in [
        (32, 128, 4, 4, 1),
        (32, 128, 4, 4, 2),
        (768, 3072, 12, 12, 4),
        (4096, 16384, 32, 8, 8),
        (64, 256, 8, 2, 2),
    ]:
        d, ff, h, hkv, n = args
        g.compare(
            f"d_model={d}, d_ff={ff}, heads={h}, kv heads={hkv}, n={n}", g.call(fn, *args), tp_params_per_rank(*args)
        )
    return g.result()


def check_tp_step_time(fn: Callable) -> CheckResult:
    g = Grader("check_tp_step_time")
    cases = [
        (0.1, 1, 12, 4096, 768, 2, 5e-6, 100e9),  # one rank: no communication
        (0.1, 2, 12, 4096, 768, 2, 5e-6, 100e9),
        (0.1, 8, 12, 4096, 768, 2, 5e-6, 100e9),
        (2.0, 8, 80, 8192, 8192, 2, 5e-6, 450e9),  # 70B-like layers over NVLink, per direction
        (2.0, 8, 80, 8192, 8192, 2, 5e-6, 50e9),  # the same over InfiniBand NDR
        (0.05, 2, 2, 512, 256, 4, 1e-4, 2e9),  # this machine's order of magnitude
    ]
    for args in cases:
        c, n, layers, t, d, b, a, bw = args
        case = f"compute {c} s, n={n}, layers={layers}, tokens={t}, d={d}, {b} bytes, alpha={a:g} s, {bw / 1e9:g} GB/s"
        g.compare(case, g.call(fn, *args), tp_step_time(*args), rtol=1e-6)
    return g.result()


# -- what the overlap hides --------------------------------------------------------------------------------
def ring_all_reduce_s(n, nbytes, alpha, beta) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def exposed_per_block(tokens, d_model, d_ff, n, flops, alpha, beta, bytes_per_value) -> tuple[float, float]:
    """The reference. Forward: g after attention and after the MLP, nothing to hide behind. Backward: f before
    Q, K, V hides behind their weight gradients (3 d x d/n), f before the MLP behind up's (d x d_ff/n)."""
    if n == 1:
        return 0.0, 0.0
    comm = ring_all_reduce_s(n, tokens * d_model * bytes_per_value, alpha, beta)
    qkv = 2 * tokens * d_model * 3 * d_model / n / flops  # the weight gradient: 2 FLOPs per multiply-add
    up = 2 * tokens * d_model * d_ff / n / flops
    return 2 * comm, max(0.0, comm - qkv) + max(0.0, comm - up)


def _without_llmedu(g: Grader, fn, *args):
    """``fn(*args)`` through ``g.call``, failing the case if it called any function of llmedu."""
    got, called = call_watching(g, fn, args, LLMEDU, exempt=lambda code: code.co_filename == str(GRADING))
    g.expect("your function works it out by hand", called is None, f"it called llmedu's {called}: write it yourself")
    return got


def check_exposed_per_block(fn: Callable) -> CheckResult:
    g = Grader("check_exposed_per_block")
    cases = [
        (4096, 1024, 4096, 1, 100e12, 5e-6, 450e9, 2),  # one rank: nothing to send
        (4096, 1024, 4096, 8, 600e12, 5e-6, 450e9, 2),  # small layers on NVLink: f hides behind neither
        (8192, 12288, 49152, 8, 600e12, 5e-6, 450e9, 2),  # GPT-3-sized layers on NVLink: both hide
        (8192, 12288, 49152, 8, 600e12, 5e-6, 50e9, 2),  # the same over InfiniBand: neither hides
        (8192, 4096, 16384, 2, 600e12, 5e-6, 80e9, 2),  # the MLP's hides, attention's partly
        (2048, 512, 2048, 2, 1e9, 4e-3, 2e6, 4),  # a CPU and a slow link: the MLP's hides, attention's partly
    ]
    for args in cases:
        tokens, d, ff, n, flops, a, b, v = args
        case = f"tokens={tokens}, d={d}, d_ff={ff}, n={n}, {flops:g} FLOP/s, alpha={a:g} s, {b:g} B/s, {v} bytes"
        got = _without_llmedu(g, fn, *args)
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        g.compare(case + ": (forward, backward) seconds", got, exposed_per_block(*args), rtol=1e-6, atol=1e-12)
    return g.result()


# -- sequence parallelism: two collectives, two products ---------------------------------------------------
class _Handle:
    def __init__(self, log: list, name: str, finish: Callable):
        self.log, self.name, self.finish, self.done = log, name, finish, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.log.append(("wait", self.name))
            self.finish()
            self.done = True
        return True


class _OneRankOfN:
    """Rank ``rank`` of ``n``, the others' data known to the grader: ``all_gather_single`` and
    ``reduce_scatter_single`` as a ``Link``'s, whose output holds NaN until ``wait()``."""

    def __init__(self, rank: int, n: int, full_x: torch.Tensor, others_partial: torch.Tensor, log: list):
        self.rank, self.n, self.full_x, self.others, self.log = rank, n, full_x, others_partial, log

    def _start(self, name, output, input, async_op, finish):
        self.log.append(("launch", name, bool(async_op)))
        sent = input.detach().clone()  # what this rank sent, at launch
        output.fill_(float("nan"))  # not there until the handle is waited on
        handle = _Handle(self.log, name, lambda: finish(output, sent))
        if not async_op:
            handle.wait()
            return None
        return handle

    def all_gather_single(self, output, input, group=None, async_op=False):
        def finish(output, sent):
            pieces = list(self.full_x.chunk(self.n))
            pieces[self.rank] = sent
            output.copy_(torch.cat(pieces))

        return self._start("all-gather", output, input, async_op, finish)

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        def finish(output, sent):
            output.copy_((sent + self.others).chunk(self.n)[self.rank])

        return self._start("reduce-scatter", output, input, async_op, finish)


class _Products(TorchDispatchMode):
    """Notes every matrix product, by the shape of its result, in the same log as the collectives."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "matmul"):
            self.log.append(("product", tuple(s for s in out.shape if s != 1)))
        return out


def sp_column_backward(x_shard, weight, grad_y, comm):
    """The reference (Megatron-LM's order with sequence parallelism)."""
    full_x = torch.empty(grad_y.shape[0], x_shard.shape[1], dtype=x_shard.dtype)  # (T, in)
    gather = comm.all_gather_single(full_x, x_shard, async_op=True)  # runs during the input gradient
    grad_x = grad_y @ weight  # (T, in): this rank's partial sum
    gather.wait()
    grad_x_shard = torch.empty_like(x_shard)  # (T / N, in)
    scatter = comm.reduce_scatter_single(grad_x_shard, grad_x, async_op=True)  # runs during the weight gradient
    grad_w = grad_y.t() @ full_x  # (out / N, in)
    scatter.wait()
    return grad_x_shard, grad_w


def check_sp_column_backward(fn: Callable) -> CheckResult:
    g = Grader("check_sp_column_backward")
    for rank, n, tokens, d_in, out_local in ((0, 2, 12, 10, 6), (1, 2, 12, 10, 6), (2, 4, 16, 10, 3)):
        gen = torch.Generator().manual_seed(10 * n + rank)
        full_x = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64)
        weight = torch.randn(out_local, d_in, generator=gen, dtype=torch.float64)
        grad_y = torch.randn(tokens, out_local, generator=gen, dtype=torch.float64)
        others = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64)  # the other ranks' partials, summed
        x_shard = full_x.chunk(n)[rank].clone()
        case = f"rank {rank} of {n}, {tokens} tokens, in={d_in}, out/N={out_local}"
        log = []
        with _Products(log):
            got = g.call(fn, x_shard, weight, grad_y, _OneRankOfN(rank, n, full_x, others, log))
        if not g.expect(f"{case}: returns (grad_x_shard, grad_w)", isinstance(got, (tuple, list)) and len(got) == 2):
            break
        expected = ((grad_y @ weight + others).chunk(n)[rank], grad_y.t() @ full_x)
        g.compare(f"{case}: (grad_x_shard, grad_w)", tuple(got), expected, atol=1e-9)
        launches = [e for e in log if e[0] == "launch"]
        g.expect(
            f"{case}: one all-gather and one reduce-scatter, each launched with async_op=True",
            sorted((e[1], e[2]) for e in launches) == [("all-gather", True), ("reduce-scatter", True)],
            f"your function launched {[(e[1], 'async' if e[2] else 'waiting') for e in launches]}",
        )
        _check_order(g, case, log, (tokens, d_in), {(out_local, d_in), (d_in, out_local)})
    return g.result()


def _check_order(g: Grader, case: str, log: list, input_shape: tuple, weight_shapes: set) -> None:
    def first(*event):
        return next((i for i, e in enumerate(log) if e[: len(event)] == event), None)

    dgrad = next((i for i, e in enumerate(log) if e == ("product", input_shape)), None)
    wgrad = next((i for i, e in enumerate(log) if e[0] == "product" and e[1] in weight_shapes), None)
    gather, scatter, scatter_done = (
        first("launch", "all-gather"),
        first("launch", "reduce-scatter"),
        first("wait", "reduce-scatter"),
    )
    gather_done = first("wait", "all-gather")
    if None in (dgrad, wgrad, gather, gather_done, scatter, scatter_done):
        g.expect(f"{case}: the two products and the two collectives were seen", False, f"the order seen: {log}")
        return
    g.expect(
        f"{case}: the all-gather runs while the input gradient is computed",
        gather < dgrad < gather_done,
        "launch the all-gather of x before grad_y @ weight and wait for it after: that product does not need x",
    )
    g.expect(
        f"{case}: the reduce-scatter runs while the weight gradient is computed",
        scatter < wgrad < scatter_done,
        "launch the reduce-scatter before the weight gradient's product and wait for it after",
    )


# -- what a rank holds ------------------------------------------------------------------------------------
def bytes_per_rank(d_model, n_layers, n_heads, vocab_size, seq_len, micro_batch, t) -> float:
    """The reference. A block's Q, K, V, output, up and down weights and the Q, K, V and up biases are split;
    the output and down biases and both norms (6 d) are whole. The tied embedding is split by rows."""
    d, s, b, a = d_model, seq_len, micro_batch, n_heads
    params = n_layers * ((12 * d * d + 7 * d) / t + 6 * d) + vocab_size * d / t
    activations = s * b * d * (10 + 24 / t + 5 * a * s / (d * t))  # per layer (table 2): 10 sbh are whole
    return 16 * params + n_layers * activations


def check_bytes_per_rank(fn: Callable) -> CheckResult:
    g = Grader("check_bytes_per_rank")
    cases = [
        (768, 12, 12, 50304, 1024, 8, 1),  # GPT-2 small, one rank
        (768, 12, 12, 50304, 1024, 8, 4),
        (4096, 32, 32, 51200, 2048, 1, 2),
        (4096, 32, 32, 51200, 2048, 4, 8),
        (12288, 96, 96, 51200, 2048, 1, 8),  # GPT-3 175B
        (64, 2, 4, 64, 64, 2, 2),
    ]
    for args in cases:
        d, layers, heads, vocab, s, b, t = args
        case = f"d={d}, layers={layers}, heads={heads}, vocab={vocab}, seq={s}, micro-batch={b}, t={t}"
        g.compare(case, _without_llmedu(g, fn, *args), bytes_per_rank(*args), rtol=1e-9)
    return g.result()
