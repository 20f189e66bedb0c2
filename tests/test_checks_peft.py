"""The lesson-17 graders pass a correct answer and fail the mistakes a learner is likely to make."""

from torch.nn import functional as F

from llmedu.checks.peft import check_lora_forward, check_lora_merge, check_prefix_parameters


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
