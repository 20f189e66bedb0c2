"""The lesson-17 graders pass a correct answer and fail the mistakes a learner is likely to make."""

from torch.nn import functional as F

from llmedu.checks.peft import (
    check_lora_forward,
    check_lora_merge,
    check_lora_parameters,
    check_lora_switch,
    check_prefix_break_even,
    check_prefix_parameters,
)


def lora_forward(x, weight, bias, A, B, alpha):
    return F.linear(x, weight, bias) + (alpha / A.shape[0]) * (x @ A.T @ B.T)


def lora_forward_unscaled(x, weight, bias, A, B, alpha):  # forgets alpha / r
    return F.linear(x, weight, bias) + x @ A.T @ B.T


def merge(weight, A, B, alpha):
    return weight + (alpha / A.shape[0]) * B @ A


def merge_transposed(weight, A, B, alpha):  # (B A)^T: wrong unless square, and then wrong values
    return weight + (alpha / A.shape[0]) * (B @ A).reshape(weight.shape[::-1]).T


def test_lora_forward_grader():
    assert check_lora_forward(lora_forward)
    assert not check_lora_forward(lora_forward_unscaled)
    assert not check_lora_forward(lambda *args: 1 / 0)  # a crash is a failure, not an error


def test_lora_merge_grader():
    assert check_lora_merge(merge)
    assert not check_lora_merge(merge_transposed)
    assert not check_lora_merge(lambda weight, A, B, alpha: weight)


def test_prefix_parameters_grader():
    assert check_prefix_parameters(lambda p, layers, kv_heads, head_dim: p * layers * 2 * kv_heads * head_dim)
    assert not check_prefix_parameters(
        lambda p, layers, kv_heads, head_dim: p * layers * kv_heads * head_dim
    )  # no values
    assert not check_prefix_parameters(lambda p, layers, kv_heads, head_dim: p * 2 * kv_heads * head_dim)  # one layer


def lora_row(r, n_layers, d_model, n_labels):
    # query and value: r (d_in + d_out) each, per layer; the head: d_model x n_labels weights and n_labels biases
    return n_layers * 2 * r * (d_model + d_model) + d_model * n_labels + n_labels


def test_lora_parameters_grader():
    assert check_lora_parameters(lora_row)
    assert not check_lora_parameters(lambda r, n_layers, d_model, n_labels: n_layers * 2 * r * 2 * d_model)  # no head
    assert not check_lora_parameters(  # B A counted as a full d x d matrix
        lambda r, n_layers, d_model, n_labels: n_layers * 2 * d_model * d_model + d_model * n_labels + n_labels
    )
    assert not check_lora_parameters(  # only A (r x d_in) counted, B forgotten
        lambda r, n_layers, d_model, n_labels: n_layers * 2 * r * d_model + d_model * n_labels + n_labels
    )


def switch(w_merged, A1, B1, A2, B2, alpha):
    return w_merged - (alpha / A1.shape[0]) * B1 @ A1 + (alpha / A2.shape[0]) * B2 @ A2


def test_lora_switch_grader():
    assert check_lora_switch(switch)
    assert not check_lora_switch(  # forgets to take adapter 1 out: serves W0 + both updates
        lambda w, A1, B1, A2, B2, alpha: w + (alpha / A2.shape[0]) * B2 @ A2
    )
    assert not check_lora_switch(  # one scaling, adapter 2's rank, for both adapters
        lambda w, A1, B1, A2, B2, alpha: w + (alpha / A2.shape[0]) * (B2 @ A2 - B1 @ A1)
    )
    assert not check_lora_switch(lambda w, A1, B1, A2, B2, alpha: w - (alpha / A1.shape[0]) * B1 @ A1)  # W0 only


def buggy_scaling(x, weight, bias, A, B, alpha):  # the lesson's find-the-bug exercise: r read from B's first axis
    return F.linear(x, weight, bias) + (alpha / B.shape[0]) * (x @ A.T @ B.T)


def test_find_the_bug_exercise_fails_until_fixed():
    assert not check_lora_forward(buggy_scaling)
    assert check_lora_forward(lora_forward)


def break_even(r, d_model, n_kv_heads, head_dim):
    # LoRA per layer: r (d + d) on q, r (d + d_kv) on v; a virtual token: 2 d_kv (its key and value) per layer
    d_kv = n_kv_heads * head_dim
    return r * (3 * d_model + d_kv) / (2 * d_kv)


def test_prefix_break_even_grader():
    assert check_prefix_break_even(break_even)
    assert not check_prefix_break_even(lambda r, d_model, n_kv_heads, head_dim: 2 * r)  # true only without GQA
    assert not check_prefix_break_even(  # v counted as d x d, as if GQA did not shrink it
        lambda r, d_model, n_kv_heads, head_dim: r * 4 * d_model / (2 * n_kv_heads * head_dim)
    )
    assert not check_prefix_break_even(  # only the key of each virtual token counted
        lambda r, d_model, n_kv_heads, head_dim: 2 * break_even(r, d_model, n_kv_heads, head_dim)
    )


def test_prefix_break_even_grader_needs_a_fraction():
    assert break_even(3, 64, 2, 8) == 19.5  # the grader's fractional case
    assert not check_prefix_break_even(  # floor division: whole answers only
        lambda r, d_model, n_kv_heads, head_dim: (
            r * (3 * d_model + n_kv_heads * head_dim) // (2 * n_kv_heads * head_dim)
        )
    )
    assert not check_prefix_break_even(lambda *args: round(break_even(*args)))
