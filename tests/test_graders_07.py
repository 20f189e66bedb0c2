"""Lessons 07 and 08's graders: each passes a right answer, and fails a plausible wrong value and a
right value computed the wrong way (running what the exercise asks to predict, or calling the library)."""

import math

import torch

from llmedu.checks.loss_scaling import _measured_skipped_steps, check_skipped_steps
from llmedu.checks.precision import (
    check_adam8bit_state_bytes,
    check_adamw_fix,
    check_additions_to_stall,
    check_float_format,
    check_fp8_underflow,
)
from llmedu.optim import AdamW8bit, adamw_update_, quantize_blockwise, state_bytes
from llmedu.optim.quantization_map import dynamic_map
from llmedu.train.fp8 import FORMATS, cast_to_fp8

SIGNIFICANT = {torch.bfloat16: 8, torch.float16: 11}


# -- lesson 07, exercise 1: additions before a running sum stalls -----------------------------------
def additions_by_grid(value, dtype):
    """The lesson's reasoning in Python floats: each s + v is rounded to the grid of its binade."""
    p, v = SIGNIFICANT[dtype], torch.tensor(value, dtype=dtype).item()
    s, n = 0.0, 0
    while True:
        exact = s + v
        ulp = 2.0 ** (math.floor(math.log2(exact)) - p + 1)
        new = round(exact / ulp) * ulp  # half to even, as the hardware rounds
        if new == s:
            return n
        s, n = new, n + 1


def additions_by_running_the_sum(value, dtype):
    """The right count, by doing the additions in the dtype: what the exercise asks to predict."""
    v, total, n = torch.tensor(value, dtype=dtype), torch.zeros((), dtype=dtype), 0
    while total + v != total:
        total, n = total + v, n + 1
    return n


def test_additions_to_stall():
    assert check_additions_to_stall(additions_by_grid)
    wrong = check_additions_to_stall(lambda v, d: round(4 / 0.01) if v == 0.01 else additions_by_grid(v, d))
    assert not wrong and "value=0.01, dtype=bf16" in wrong.failure  # 400, stall / v
    wrong_way = check_additions_to_stall(additions_by_running_the_sum)
    assert not wrong_way and "adds tensors" in wrong_way.failure
    rounded_by_torch = check_additions_to_stall(additions_by_rounding_each_sum)
    assert not rounded_by_torch and "torch calls" in rounded_by_torch.failure


def additions_by_rounding_each_sum(value, dtype):
    """The running sum in disguise: Python adds, torch rounds every partial sum to the dtype."""
    v = torch.tensor(value, dtype=dtype).item()
    s, n = 0.0, 0
    while (new := torch.tensor(s + v, dtype=dtype).item()) != s:
        s, n = new, n + 1
    return n


# -- lesson 07, exercise 2: the range of a format from its bits --------------------------------------
def format_from_bits(e, m, ieee):
    bias = 2 ** (e - 1) - 1
    top, mantissa = (2**e - 2 - bias, 2 - 2.0**-m) if ieee else (2**e - 1 - bias, 2 - 2.0 ** (1 - m))
    return 2.0**top * mantissa, 2.0 ** (1 - bias), 2.0 ** (1 - bias - m)


DTYPES = {(8, 23): torch.float32, (8, 7): torch.bfloat16, (5, 10): torch.float16}


def format_by_lookup(e, m, ieee):
    """The right numbers read from torch.finfo and FORMATS, TF32 by hand: no derivation."""
    if (e, m) in DTYPES:
        fi = torch.finfo(DTYPES[e, m])
        return fi.max, fi.smallest_normal, fi.smallest_normal * fi.eps
    for f in FORMATS.values():
        if (f.exponent_bits, f.mantissa_bits) == (e, m):
            return f.max, f.min_normal, f.min_subnormal
    return format_from_bits(e, m, ieee)


def test_float_format():
    assert check_float_format(format_from_bits)
    wrong = check_float_format(lambda e, m, ieee: format_from_bits(e, m, True))  # E4M3 as IEEE: max 240
    assert not wrong and "E4M3" in wrong.failure
    wrong_way = check_float_format(format_by_lookup)
    assert not wrong_way and "torch.finfo and FORMATS are the answer key" in wrong_way.failure
    assert FORMATS and torch.finfo(torch.float16).max == 65504  # the grader put both back
    tabled = check_float_format(format_from_a_precomputed_table)
    assert not tabled and "E6M9" in tabled.failure


TABLE = {}  # (e, m, ieee) -> the range, read off torch.finfo and FORMATS *before* the grader runs
for _dtype, _key in [(torch.float32, (8, 23, True)), (torch.bfloat16, (8, 7, True)), (torch.float16, (5, 10, True))]:
    _fi = torch.finfo(_dtype)
    TABLE[_key] = (_fi.max, _fi.smallest_normal, _fi.smallest_normal * _fi.eps)
for _f in FORMATS.values():
    TABLE[_f.exponent_bits, _f.mantissa_bits, not _f.saturates] = (_f.max, _f.min_normal, _f.min_subnormal)
TABLE[8, 10, True] = (2.0**127 * (2 - 2.0**-10), 2.0**-126, 2.0**-136)


def format_from_a_precomputed_table(e, m, ieee):
    """Every known format looked up in a dict filled outside the function: switching finfo off does not stop it."""
    return TABLE[e, m, ieee]


def test_float_format_reference_decodes_known_formats_as_finfo_does():
    from llmedu.checks.precision import _decoded_range

    assert _decoded_range(5, 10, True) == TABLE[5, 10, True]
    assert _decoded_range(8, 7, True) == TABLE[8, 7, True]
    assert _decoded_range(4, 3, False) == TABLE[4, 3, False] and _decoded_range(5, 2, True) == TABLE[5, 2, True]


def test_float_format_refuses_the_table_of_formats_too():
    def formats_only(e, m, ieee):  # fp16/bf16/fp32 derived, fp8 read off the table
        for f in FORMATS.values():
            if (f.exponent_bits, f.mantissa_bits) == (e, m):
                return f.max, f.min_normal, f.min_subnormal
        if (e, m) in [(4, 3), (5, 2)]:
            raise KeyError("no such format in the table")
        return format_from_bits(e, m, ieee)

    result = check_float_format(formats_only)
    assert not result and "KeyError" in result.failure and "switched off" in result.failure


# -- lesson 07, exercise 3: steps a dynamic loss scaler skips ----------------------------------------
def skipped_by_the_rules(init_scale, growth_interval, overflow_scale, n_steps):
    """The scaler's rules in plain Python: halve and skip on overflow, double after a clean streak."""
    scale, clean, skipped = init_scale, 0, 0
    for _ in range(n_steps):
        if scale >= overflow_scale:
            scale, clean, skipped = scale / 2, 0, skipped + 1
        else:
            clean += 1
            if clean == growth_interval:
                scale, clean = scale * 2, 0
    return skipped


def skipped_by_grad_scaler(init_scale, growth_interval, overflow_scale, n_steps):
    """The right count, by replaying torch.amp.GradScaler: the measurement, not a prediction."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    p = torch.nn.Parameter(torch.ones(1))
    opt, skipped = torch.optim.SGD([p], lr=0.0), 0
    for _ in range(n_steps):
        scaler.scale(torch.zeros(()))
        overflow = scaler.get_scale() >= overflow_scale
        p.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        skipped += overflow
    return skipped


def skipped_by_closed_form(init_scale, growth_interval, overflow_scale, n_steps):
    """The halvings down from the guess, the climb back to the line, then one skip every growth_interval + 1 steps."""
    scale, halvings = init_scale, 0
    while scale >= overflow_scale:  # every step at or above the line is skipped and halves S
        scale, halvings = scale / 2, halvings + 1
    if n_steps <= halvings:
        return n_steps
    doublings = 0
    while scale * 2**doublings < overflow_scale:  # clean streaks needed to reach the line again
        doublings += 1
    climb = doublings * growth_interval + 1  # the clean steps up, and the first probe
    if n_steps - halvings < climb:
        return halvings
    return halvings + 1 + (n_steps - halvings - climb) // (growth_interval + 1)  # probe, halve, one streak back


def test_skipped_steps():
    assert check_skipped_steps(skipped_by_closed_form)
    replayed = check_skipped_steps(skipped_by_the_rules)  # right on every small case: only the time limit fails it
    assert not replayed and "n_steps=1,000,000,000,000" in replayed.failure and "more than 2 s" in replayed.failure
    strict = lambda s0, g, line, n: skipped_by_closed_form(s0, g, line * 2, n)  # overflow only *above* the line
    assert not check_skipped_steps(strict)
    # a plausible closed form: the halvings to get under the line, then one skip per growth_interval steps
    first = lambda s0, line: max(0, math.ceil(math.log2(s0 / line)) + (s0 >= line and s0 == line))
    per_interval = lambda s0, g, line, n: first(s0, line) + (n - first(s0, line)) // g
    wrong = check_skipped_steps(per_interval)  # the period is growth_interval + 1: the skipped step counts too
    assert not wrong and "n_steps=600" in wrong.failure
    wrong_way = check_skipped_steps(skipped_by_grad_scaler)
    assert not wrong_way and "running GradScaler or LossScaler" in wrong_way.failure
    assert torch.amp.GradScaler("cpu").get_scale() == 2.0**16  # the grader put GradScaler back


def test_skipped_steps_reference_counts_out_a_measured_cycle():
    """The grader replays GradScaler until its state repeats and multiplies that cycle out: a full replay agrees."""
    for args in [
        (2.0**24, 10, 2.0**20, 600),
        (2.0**4, 5, 2.0**20, 200),
        (2.0**16, 3, 2.0**13, 50),
        (1024.0, 7, 2.0**12, 23),
        (3.0, 4, 100.0, 157),
        (2.0**16, 20, 5e4, 1000),
        (2.0**20, 10, 2.0**20, 7),
    ]:
        assert _measured_skipped_steps(*args) == skipped_by_grad_scaler(*args) == skipped_by_the_rules(*args), args
    assert _measured_skipped_steps(2.0**16, 2000, 5e4, 10**12) == skipped_by_closed_form(2.0**16, 2000, 5e4, 10**12)


# -- lesson 08, exercise 3: the share of a normal tensor that an fp8 cast sends to 0 --------------
def underflow_by_formula(std, fmt, scale):
    half_smallest = FORMATS[fmt].min_subnormal / 2  # below it (and at it: a tie to even) the cast gives 0
    return math.erf(half_smallest / (scale * std * math.sqrt(2)))


def underflow_by_casting(std, fmt, scale):
    """The right share, by casting a large sample: the experiment, not a prediction."""
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * std
    return float((cast_to_fp8((x * scale).float(), fmt) == 0).double().mean())


def test_fp8_underflow():
    assert check_fp8_underflow(underflow_by_formula)
    smallest = lambda std, fmt, scale: math.erf(FORMATS[fmt].min_subnormal / (scale * std * math.sqrt(2)))
    wrong = check_fp8_underflow(smallest)  # the smallest subnormal as the threshold: rounding up forgotten
    assert not wrong and "std=0.02" in wrong.failure
    assert not check_fp8_underflow(lambda std, fmt, scale: underflow_by_formula(std, fmt, 1.0))  # scale ignored
    wrong_way = check_fp8_underflow(underflow_by_casting)
    assert not wrong_way and "without sampling or casting a tensor" in wrong_way.failure


# -- lesson 08, exercise 1: find the bug in an AdamW step -------------------------------------------
def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, bias2_beta=None):
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    m_hat = exp_avg / (1 - beta1**step)
    v_hat = exp_avg_sq / (1 - (bias2_beta or beta2) ** step)
    param = param - lr * m_hat / (v_hat.sqrt() + eps)
    return param, exp_avg, exp_avg_sq


def adamw_by_library(param, grad, exp_avg, exp_avg_sq, *hyper):
    """The right step by calling the library's adamw_update_ on copies: no bug found, none fixed."""
    param, exp_avg, exp_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    adamw_update_(param, grad, exp_avg, exp_avg_sq, *hyper)
    return param, exp_avg, exp_avg_sq


def adamw_by_torch(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    p.grad = grad.clone()
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def test_adamw_fix():
    assert check_adamw_fix(adamw_step)
    buggy = lambda *args: adamw_step(*args, bias2_beta=args[6])  # beta1 in v's correction
    assert not check_adamw_fix(buggy)
    assert not check_adamw_fix(adam_with_l2)  # the lesson's code: decay added to the gradient


def adam_with_l2(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """The lesson's planted bug: coupled L2 decay, g += wd * p, which then passes through m and v."""
    grad = grad + weight_decay * param
    return adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, 0.0)


def test_adamw_fix_does_not_name_the_planted_mistake():
    result = check_adamw_fix(adam_with_l2)
    assert not result and "Hint" not in result.failure and "coupled" not in result.failure
    assert check_adamw_fix.__module__ == "llmedu.checks.adamw_fix"


def adamw_in_place(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """A right fix written in place with lerp_, as torch's own step does: not a library call."""
    param, exp_avg, exp_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
    return param, exp_avg, exp_avg_sq


def test_adamw_fix_accepts_an_in_place_step_with_lerp():
    assert check_adamw_fix(adamw_in_place)


def test_headline_case_is_case_1_even_after_method_checks():
    right_first = lambda v, d: additions_by_grid(v, d) if (v, d) == (0.01, torch.bfloat16) else -1
    result = check_additions_to_stall(right_first)
    assert not result and "case 2 of the check" in str(result) and "value=0.001" in result.failure


def test_headline_cases_say_only_higher_or_lower():
    result = check_skipped_steps(lambda *args: 0)
    assert not result and "too low" in result.failure and "expected" not in result.failure
    result = check_additions_to_stall(lambda value, dtype: 400)  # 4 / 0.01
    assert not result and "too high" in result.failure and "expected" not in result.failure
    result = check_fp8_underflow(lambda std, fmt, scale: 0.5)
    assert not result and "too high" in result.failure and "expected" not in result.failure


def test_adamw_fix_lists_the_wrong_ways():
    for wrong_way in (adamw_by_library, adamw_by_torch):
        result = check_adamw_fix(wrong_way)
        assert not result and "fix the given code instead" in result.failure


# -- lesson 08, exercise 2: AdamW8bit's state bytes, counted -----------------------------------------
def state_bytes_counted(numel, block_size, min_8bit_size):
    if numel < min_8bit_size:
        return 8 * numel + 4  # fp32 m and v, and the step counter
    return 2 * numel + 2 * 4 * math.ceil(numel / block_size) + 4  # codes, one absmax per block each, step


def state_bytes_measured(numel, block_size, min_8bit_size):
    """The right bytes by building the optimizer and counting its tensors: the measurement itself."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.ones(numel)
    opt = AdamW8bit([p], block_size=block_size, min_8bit_size=min_8bit_size)
    opt.step()
    return state_bytes(opt)


def test_adam8bit_state_bytes():
    assert check_adam8bit_state_bytes(state_bytes_counted)
    assert not check_adam8bit_state_bytes(lambda n, b, t: 2 * n + 4)  # the absmax forgotten
    wrong_way = check_adam8bit_state_bytes(state_bytes_measured)
    assert not wrong_way and "building an AdamW8bit measures them" in wrong_way.failure
    by_quantizing = check_adam8bit_state_bytes(state_bytes_by_quantizing)
    assert not by_quantizing and "quantize_blockwise" in by_quantizing.failure


def state_bytes_by_quantizing(numel, block_size, min_8bit_size):
    """The right bytes by quantizing a tensor of that size and adding up what comes back."""
    if numel < min_8bit_size:
        return 8 * numel + 4
    codes, absmax = quantize_blockwise(torch.zeros(numel), dynamic_map(), block_size)
    return 2 * (codes.numel() + 4 * absmax.numel()) + 4


def test_float_format_case_n_is_the_nth_format():
    # E4M3 is the fourth format asked: its failure is case 4, not case 8 (a passing shape check is no case)
    wrong = check_float_format(lambda e, m, ieee: format_from_bits(e, m, True))
    assert not wrong and "case 4 of the check" in str(wrong) and "E4M3" in wrong.failure
    assert "all 8 cases" in str(check_float_format(format_from_bits))
