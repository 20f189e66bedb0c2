"""Graders for lesson 05 (a transformer from scratch): where the parameters and the FLOPs of a GPT are.

check_gpt2_parameters(fn)   fn(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied) -> the number of
                            parameters of a GPT-2-style model (learned positions, pre-LN LayerNorms with
                            biases, biased linear layers, a final norm), with the output matrix tied to the
                            token embedding or not
check_llama_flops(fn)       fn(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, seq_len) -> training
                            FLOPs per token, 6N + 12 L T d, of a LLaMA-style model (SwiGLU, GQA, untied output)
check_attention_crossover(t)    the context length at which Llama-2 7B's attention FLOPs equal its weights'
check_unshifted_predictions(loss, generates, why)   exercise 2's predictions: a number and two choices

Both counts must be worked out by hand: building a model (ours on the ``meta`` device, a ``transformers``
one, or ``torch.nn`` layers) or asking ``llmedu`` (``flops_per_token``, ``matmul_parameters``, this file's
references) fails. The parameter reference is not a formula: it builds our ``CausalLM`` on the ``meta``
device (shapes, no storage) and counts, so a 1.5B-parameter case costs nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmedu.checks.core import CheckResult, Grader, call_watching
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.counting import count_parameters

__all__ = ["check_gpt2_parameters", "check_llama_flops", "check_attention_crossover", "check_unshifted_predictions"]
__all__ += ["llama_matmul_parameters", "GENERATES", "WHY"]

_LLMEDU = str(Path(__file__).resolve().parents[1])
_GRADING = str(Path(__file__).resolve().parent / "core.py")  # the Grader itself, which runs the learner's function
_BUILDERS = [str(Path(torch.nn.__file__).resolve().parent)]  # torch/nn: any layer, on any device
try:
    import transformers

    _BUILDERS.append(str(Path(transformers.__file__).resolve().parent))
except ImportError:  # transformers is optional; without it, nobody can build one of its models either
    pass


def _not_a_shortcut(code) -> bool:
    """True for calls that do not count: anything outside llmedu, torch.nn and transformers, and the Grader."""
    where = code.co_filename
    if where == _GRADING:
        return True
    return not (where.startswith(_LLMEDU) or any(where.startswith(b) for b in _BUILDERS))


def _by_hand(g: Grader, fn, args: tuple, case: str):
    """``fn(*args)``, or FAILED with the shortcut it took named (a model built, or the library asked)."""
    got, called = call_watching(g, fn, args, Path("/"), exempt=_not_a_shortcut)
    if called is not None:
        g.expect(case, False, f"your function calls {called}: count by hand, without building a model or asking llmedu")
    return got


# -- exercise 3: parameters ---------------------------------------------------------------------------------
# GPT-2 small and XL (Radford et al. 2019, table 2), an odd-sized model with a narrow FFN, and two
# untied models: the lesson shows tied GPT-2s only.
_CASES = [
    (50257, 1024, 768, 12, 3072, True),
    (50257, 1024, 1600, 48, 6400, True),
    (101, 64, 96, 2, 136, True),
    (256, 128, 128, 4, 512, False),
    (32000, 2048, 512, 6, 1376, False),
]


def _reference(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied) -> int:
    config = TransformerConfig.gpt2(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=1,  # the head count does not change the parameter count
        d_ff=d_ff,
        tie_embeddings=tied,
    )
    with torch.device("meta"):
        return count_parameters(CausalLM(config))


def check_gpt2_parameters(fn) -> CheckResult:
    """Grade ``fn(vocab_size, max_seq_len, d_model, n_layers, d_ff, tied)`` against a model built on ``meta``."""
    g = Grader("check_gpt2_parameters")
    for case in _CASES:
        V, T, d, L, f, tied = case
        name = f"V={V}, T={T}, d={d}, L={L}, d_ff={f}, {'tied' if tied else 'untied'}"
        g.compare(name, _by_hand(g, fn, case, name), _reference(*case))
    return g.result()


# -- exercise 1: FLOPs, and where attention catches up -----------------------------------------------------
def llama_matmul_parameters(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff) -> int:
    """N of 6N for a LLaMA-style model: q, k, v, o (k and v of n_kv_heads heads), three SwiGLU matrices
    per layer, and the output projection; the embedding table is a lookup, not a matmul."""
    kv_dim = n_kv_heads * (d_model // n_heads)
    per_layer = 2 * d_model * d_model + 2 * d_model * kv_dim + 3 * d_model * d_ff
    return n_layers * per_layer + d_model * vocab_size


def check_llama_flops(fn) -> CheckResult:
    """``fn(vocab_size, d_model, n_layers, n_heads, n_kv_heads, d_ff, seq_len)``: 6N + 12 L T d per token."""
    g = Grader("check_llama_flops")
    cases = [
        ("a small GQA model", (384, 96, 2, 6, 2, 256, 16)),
        ("an MQA model", (1000, 64, 3, 4, 1, 172, 128)),
        ("Llama-2 7B at 4096 tokens", (32000, 4096, 32, 32, 32, 11008, 4096)),
        ("Llama-2 70B at 4096 tokens", (32000, 8192, 80, 64, 8, 28672, 4096)),
    ]
    for name, (V, d, L, H, H_kv, d_ff, T) in cases:
        n = llama_matmul_parameters(V, d, L, H, H_kv, d_ff)
        expected = float(6 * n + 12 * L * T * d)
        got = _by_hand(g, fn, (V, d, L, H, H_kv, d_ff, T), name)
        if isinstance(got, (int, float)) and not isinstance(got, bool):
            if math.isclose(got, expected + 6 * V * d, rel_tol=1e-9):
                g.expect(name, False, "you counted the embedding table: it is a lookup, not a matmul")
            elif H_kv != H and math.isclose(got, expected - 12 * L * T * d * (1 - H_kv / H), rel_tol=1e-9):
                g.expect(
                    name,
                    False,
                    "you scaled the attention term by n_kv_heads / n_heads: the heads share keys and values, "
                    "but every query head still computes its own QK^T and PV",
                )
        case = f"{name}: V={V}, d={d}, L={L}, {H} heads, {H_kv} KV heads, d_ff={d_ff}, T={T}"
        g.compare(case, got, expected, rtol=1e-9)
    return g.result()


_LLAMA2_7B = (32000, 4096, 32, 32, 32, 11008)


def check_attention_crossover(t) -> CheckResult:
    """``t``: the context length at which Llama-2 7B's 12 L T d equals its 6N (N of matmuls), to 1%."""
    g = Grader("check_attention_crossover")
    V, d, L, *_ = _LLAMA2_7B
    n = llama_matmul_parameters(*_LLAMA2_7B)
    expected = n / (2 * L * d)
    name = "Llama-2 7B's crossover context length"
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        g.expect(name, False, f"got {type(t).__name__}: give the context length as a number of tokens")
        return g.result()
    all_weights = (n + V * d) / (2 * L * d)
    hints = {  # a plausible wrong N, or a wrong attention term: what each gives, and why it is wrong
        all_weights: "N includes the embedding table there; 6N counts the weights used in matmuls only",
        (n - V * d) / (2 * L * d): "the output projection is a matmul (d x V per token): it belongs in N",
        6 * d: "12 L d^2 is GPT-2's block without Llama's wider SwiGLU FFN and the output projection",
        2 * expected: "that is 6N = 6 L T d (one attention product per layer); QK^T and PV are two",
        7e9 / (2 * L * d): "7B is the model's name, not its N",
    }
    for value, why in hints.items():
        if math.isclose(t, value, rel_tol=2e-3):
            g.expect(name, False, f"got {t:,.0f}: {why}")
    g.compare(name, float(t), expected, rtol=0.01)
    return g.result()


# -- exercise 2: the unshifted loss, predicted before it is fixed -----------------------------------------
GENERATES = {
    "a": "text like the correctly trained model's, since its loss is lower",
    "b": "the prompt's last byte, again and again",
    "c": "bytes drawn uniformly at random",
    "d": "the prompt again, from its first byte",
}
WHY = {
    "a": "the mask is added after the softmax, too late to hide any position",
    "b": "flatten(0, 1) joins the batch's sequences, so each one sees the next one's tokens",
    "c": "the mask hides only later positions: position t holds token t itself, the token it is scored on",
    "d": "the mask is applied at generation time only, not during training",
}


def check_unshifted_predictions(loss, generates, why) -> CheckResult:
    """Exercise 2's predictions for a byte-level GPT trained on the unshifted loss: the training loss it
    settles at (nats per byte, a number), what it generates after a prompt (a letter of ``GENERATES``)
    and why the causal mask does not stop it (a letter of ``WHY``)."""
    g = Grader("check_unshifted_predictions")
    if not isinstance(loss, (int, float)) or isinstance(loss, bool):
        g.expect("the training loss", False, f"got {type(loss).__name__}: give a number of nats per byte")
    else:  # one case per answer, right or wrong: "all 3 cases", and "case 3" is the third answer
        g.expect(
            "the training loss",
            0 <= loss <= 0.3,
            f"got {loss}: ask what position t is given as input, and what the unshifted loss asks it to predict",
        )
    for name, answer, options, right in (("what it generates", generates, GENERATES, "b"), ("why", why, WHY, "c")):
        letter = answer.strip().lower() if isinstance(answer, str) else answer
        if letter not in options:
            g.expect(name, False, f"got {answer!r}: answer with one of the letters {sorted(options)}")
        else:
            g.expect(name, letter == right, f"got {letter!r} ({options[letter]}): not what the model does")
    return g.result()
