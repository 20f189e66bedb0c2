"""Lesson 08's graders: each passes the right answer and fails a plausible wrong value and a right value reached
the wrong way (by running what the exercise asks to predict, or by calling a library Adam step)."""

import math
import time

import torch
from torch.optim.adam import adam

from llmedu.checks.adamw_fix import check_adamw_fix
from llmedu.checks.low_precision import (
    DECAY_CASES,
    DECAY_LINE_BUDGET,
    LINE_BUDGET,
    MAP_CASES,
    REPLAY_STEPS,
    TIME_LIMIT_S,
    _final_weight,
    _replay,
    check_decay_ratio,
    check_dynamic_map_error,
    measured_decay_ratio,
)
from llmedu.optim.quantization_map import dynamic_map


# -- exercise 1: coupled against decoupled decay ----------------------------------------------------
def decay_ratio(w, grad, lr, weight_decay, steps):
    # coupled: the decay lr * wd * w is divided by sqrt(v_hat) + eps, and v_hat ~ grad^2 + (wd * w)^2
    return 1 / (math.sqrt(grad**2 + (weight_decay * w) ** 2) + 1e-8)


def decay_ratio_by_running(w, grad, lr, weight_decay, steps):
    """The right ratio, by running the optimizers: the measurement, not a prediction."""
    return measured_decay_ratio(w, grad, lr, weight_decay, steps)


def test_decay_ratio():
    assert check_decay_ratio(decay_ratio)
    wrong = check_decay_ratio(lambda w, grad, lr, wd, steps: 1 / grad)  # v_hat from the gradient alone
    assert not wrong and "too high" in wrong.failure and f"grad={DECAY_CASES[0][1]}" in wrong.failure
    no_grad = check_decay_ratio(lambda w, grad, lr, wd, steps: 1 / (wd * abs(w)))  # right only when grad << wd * w
    assert not no_grad and "grad=2.0" in no_grad.failure
    assert not check_decay_ratio(lambda *args: 1.0)  # "the same decay": the bug would not matter
    wrong_way = check_decay_ratio(decay_ratio_by_running)
    assert not wrong_way and "running the two optimizers" in wrong_way.failure


def test_decay_ratio_reference_is_a_measurement_the_formula_approximates():
    for case in DECAY_CASES:  # the prediction is a linearisation: within the grader's 5% on every case
        assert math.isclose(decay_ratio(*case), measured_decay_ratio(*case), rel_tol=0.05), case


# -- exercise 2: the largest relative error of the dynamic map in one decade ------------------------
def map_error(decade, signed):
    if decade == 6:
        return 1.0  # the last decade: the values below its first code's half-way point round to 0
    bins = 2 ** ((6 if signed else 7) - decade)  # the decade's codes: midpoints of equal bins of [0.1, 1]
    w = 0.9 / bins  # bin width, in units of 10^-decade
    inside = (w / 2) / (0.1 + w)  # half-way between the decade's first two codes
    below = 3 * w / (1 + 2 * w)  # half-way between the next decade's top code and this one's first
    return max(inside, below)


def test_dynamic_map_error():
    assert check_dynamic_map_error(map_error)
    half_gap_at_bottom = lambda d, s: 0.45 / 2 ** ((6 if s else 7) - d) / 0.1  # the gap to the decade's bottom edge
    wrong = check_dynamic_map_error(half_gap_at_bottom)
    assert not wrong and "decade=3" in wrong.failure and "too high" in wrong.failure
    inside_only = lambda d, s: (
        1.0 if d == 6 else (0.45 / 2 ** ((6 if s else 7) - d)) / (0.1 + 0.9 / 2 ** ((6 if s else 7) - d))
    )
    wrong = check_dynamic_map_error(inside_only)  # forgets the wider gap down to the next decade's codes
    assert not wrong and "decade=3" in wrong.failure and "too low" in wrong.failure

    def by_scanning(decade, signed):  # the right number, by building the map and scanning it
        code = dynamic_map(signed).double()
        x = torch.logspace(-(decade + 1), -decade, 200_001, dtype=torch.float64)
        q = code[(x[:, None] - code).abs().argmin(1)]
        return float(((q - x).abs() / x).max())

    wrong_way = check_dynamic_map_error(by_scanning)
    assert not wrong_way and "building the map and scanning it" in wrong_way.failure


# -- exercise 1's fix: a library Adam step is refused, whatever route reaches it --------------------
def adam_by_torch_adam(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.Adam(
        [p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=True
    )
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone()}
    p.grad = grad.clone()
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def adam_by_functional(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param, exp_avg, exp_avg_sq = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    adam(
        [param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step - 1))],
        decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=False,
    )  # fmt: skip
    return param, exp_avg, exp_avg_sq


def test_adamw_fix_refuses_every_route_into_torch_optim():
    for route, name in [(adam_by_torch_adam, "torch.optim.Adam"), (adam_by_functional, "torch.optim.adam.adam")]:
        result = check_adamw_fix(route)
        assert not result, name  # the values are right: only the method fails it
        assert "library Adam step" in result.failure and "torch.optim" in result.failure, result.failure


# -- exercise 3: an answer that samples with numpy instead of predicting ------------------------------
def test_fp8_underflow_refuses_numpy_sampling():
    import numpy as np

    from llmedu.checks.precision import check_fp8_underflow
    from llmedu.train.fp8 import FORMATS

    def by_numpy_sampling(std, fmt, scale):  # close to right, by sampling: an experiment, not a prediction
        x = np.abs(np.random.default_rng(0).normal(0.0, std * scale, 2_000_000))
        return float(np.mean(x <= FORMATS[fmt].min_subnormal / 2))

    result = check_fp8_underflow(by_numpy_sampling)
    assert not result and "torch or numpy" in result.failure and "numpy." in result.failure


# -- the method, with plain Python and numpy: simulating or scanning is refused, deriving passes -------
def decay_ratio_by_simulating(w, grad, lr, weight_decay, steps, cap=None, sqrt=math.sqrt, number=float):
    """The right ratio by a scalar Adam loop in plain Python: no torch, but a simulation, not a prediction. With
    ``cap``, only the first min(steps, cap) steps: the ratio settles long before 200, so a capped run is right."""
    b1, b2 = 0.9, 0.999

    def final(wd, coupled):
        p, m, v = number(w), 0.0, 0.0
        for t in range(1, min(steps, cap or steps) + 1):
            g = (grad if t % 2 else -grad) + (wd * p if coupled else 0.0)
            p -= 0.0 if coupled else lr * wd * p
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            p -= lr * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + 1e-8)
        return p

    none = final(0.0, False)
    return (none - final(weight_decay, True)) / (none - final(weight_decay, False))


def test_decay_ratio_refuses_a_plain_python_simulation_by_its_line_budget():
    result = check_decay_ratio(decay_ratio_by_simulating)
    assert not result and f"steps={DECAY_CASES[0][-1]:,}" in result.failure, result.failure
    assert f"more than {DECAY_LINE_BUDGET} lines" in result.failure, result.failure


def test_decay_ratio_refuses_a_capped_simulation_and_passes_the_closed_form():
    import numpy as np

    capped = {
        "cap 200": lambda *case: decay_ratio_by_simulating(*case, cap=200),
        "cap 20,000": lambda *case: decay_ratio_by_simulating(*case, cap=20_000),
        "cap 200, numpy floats": lambda *case: decay_ratio_by_simulating(
            *case, cap=200, sqrt=np.sqrt, number=np.float64
        ),
    }
    for name, fn in capped.items():
        for case in DECAY_CASES[:-1]:  # the values are right: only the method fails it
            assert math.isclose(fn(*case), measured_decay_ratio(*case), rel_tol=0.05), (name, case)
        result = check_decay_ratio(fn)
        assert not result and "cannot finish" not in result.failure, (name, result.failure)
        if "numpy" in name:  # its closure holds np.sqrt and np.float64
            assert "torch or numpy (np)" in result.failure, result.failure
        else:
            assert "lines of Python" in result.failure and "for all of them or for some" in result.failure, name
    assert check_decay_ratio(decay_ratio)  # 1 / sqrt(g^2 + (lambda w)^2): a few lines, within the budget


def test_decay_ratio_reports_an_answer_that_raises():
    def unfinished(w, grad, lr, weight_decay, steps):  # the exercise cell as the learner first runs it
        raise NotImplementedError("your code here")

    result = check_decay_ratio(unfinished)  # reading the traceback is the grader's work, outside the line budget
    assert not result and "raised NotImplementedError: your code here" in result.failure, result.failure


def test_decay_ratio_time_limit_does_not_suggest_a_cap():
    def slow_formula(w, grad, lr, weight_decay, steps):  # few lines, but slow: the time limit, not the budget
        time.sleep(TIME_LIMIT_S + 0.1)
        return decay_ratio(w, grad, lr, weight_decay, steps)

    result = check_decay_ratio(slow_formula)
    assert not result and f"more than {TIME_LIMIT_S:g} s" in result.failure, result.failure
    assert "for all of them or for some" in result.failure and "cannot finish" not in result.failure


def test_decay_ratio_refuses_numpy():
    import numpy as np

    def by_numpy(w, grad, lr, weight_decay, steps):  # the formula, with numpy's sqrt of an array
        return float(1 / (np.sqrt(np.array([grad**2 + (weight_decay * w) ** 2])) + 1e-8)[0])

    result = check_decay_ratio(by_numpy)
    assert not result and "torch or numpy" in result.failure, result.failure


def test_decay_ratio_refuses_numpy_ufuncs_and_numpy_scalars():
    import numpy as np

    def by_ufunc(w, grad, lr, weight_decay, steps):  # a ufunc call makes no event the profiler sees
        return float(1 / np.sqrt(grad**2 + (weight_decay * w) ** 2))

    def by_default_argument(w, grad, lr, weight_decay, steps, root=np.sqrt):  # no numpy name: a numpy scalar back
        return 1 / root(grad**2 + (weight_decay * w) ** 2)

    namespace = {"__name__": "notebook"}  # a notebook's globals: numpy imported by name, and a helper that uses it
    exec(
        "from numpy import sqrt\n"
        "def root(x):\n    return float(sqrt(x))\n"
        "def by_helper(w, grad, lr, weight_decay, steps):\n    return 1 / root(grad**2 + (weight_decay * w) ** 2)\n",
        namespace,
    )
    for fn in (by_ufunc, by_default_argument, namespace["by_helper"]):
        assert math.isclose(fn(*DECAY_CASES[0]), decay_ratio(*DECAY_CASES[0]), rel_tol=1e-6)  # right values
        result = check_decay_ratio(fn)
        assert not result and "torch or numpy" in result.failure, (fn.__name__, result.failure)


def test_long_run_reference_is_the_replayed_cycle_and_the_replay_is_adamw_update():
    for coupled in (False, True):  # the Python replay follows adamw_update_ step for step
        w, grad, lr, wd, steps = DECAY_CASES[1]
        replayed = w + _replay(w, grad, lr, wd, steps, coupled)[-1]
        assert math.isclose(replayed, _final_weight(w, grad, lr, wd, steps, coupled), rel_tol=1e-12)
    case = DECAY_CASES[-1]
    assert case[-1] > REPLAY_STEPS  # the long case is counted out from a settled cycle, not replayed
    assert math.isclose(measured_decay_ratio(*case), decay_ratio(*case), rel_tol=1e-3)


def map_error_by_plain_python_scan(decade, signed):
    """The right number by rebuilding the map in plain Python and scanning its decision boundaries."""
    bits = 6 if signed else 7
    mags = [10.0**-e * (0.1 + 0.9 * (i + 0.5) / 2 ** (bits - e)) for e in range(7) for i in range(2 ** (bits - e))]
    code = sorted([0.0, 1.0] + mags + ([-x for x in mags] if signed else []))
    lo, hi = 10.0 ** -(decade + 1), 10.0**-decade
    xs = [x for x in ((a + b) / 2 for a, b in zip(code, code[1:])) if lo <= x <= hi] + [lo, hi]
    return max(min(abs(c - x) for c in code) / x for x in xs)


def test_dynamic_map_error_refuses_a_plain_python_rebuild_and_numpy():
    assert math.isclose(map_error_by_plain_python_scan(3, True), map_error(3, True), rel_tol=1e-4)  # right values
    result = check_dynamic_map_error(map_error_by_plain_python_scan)
    assert not result and "lines of Python" in result.failure and f"at most {LINE_BUDGET}" in result.failure

    import numpy as np

    def by_numpy(decade, signed):  # the formula through numpy
        return float(np.max(np.array([map_error(decade, signed)])))

    result = check_dynamic_map_error(by_numpy)
    assert not result and "torch or numpy" in result.failure, result.failure


def map_error_by_numpy_ufunc_rebuild(decade, signed):
    """The right number by rebuilding the map with numpy ufuncs on lists: few Python lines, no profiled call."""
    import numpy as np

    bits = 6 if signed else 7
    exps = sum(([e] * 2 ** (bits - e) for e in range(7)), [])  # (127,) each positive value's decade
    idx = sum((list(range(2 ** (bits - e))) for e in range(7)), [])  # its bin inside that decade
    bins = np.power(2.0, np.subtract(bits, exps))
    frac = np.add(0.1, np.divide(np.multiply(0.9, np.add(idx, 0.5)), bins))
    mags = np.multiply(np.power(10.0, np.negative(exps)), frac)
    code = sorted(list(mags) + [0.0, 1.0] + (list(np.negative(mags)) if signed else []))
    lo, hi = 10.0 ** -(decade + 1), 10.0**-decade
    mids = np.multiply(np.add(code[1:], code[:-1]), 0.5)  # the decision boundaries, half a gap from two values
    err = np.divide(np.multiply(np.subtract(code[1:], code[:-1]), 0.5), mids)
    inside = np.logical_and(np.greater_equal(mids, lo), np.less_equal(mids, hi))
    ends = [min(np.abs(np.subtract(code, x))) / x for x in (lo, hi)]
    return float(max(max(np.multiply(err, inside)), *ends))


def test_dynamic_map_error_refuses_a_rebuild_with_numpy_ufuncs():
    for decade, signed in ((3, True), (0, False), (6, True)):  # the values are right: only the method fails it
        assert math.isclose(map_error_by_numpy_ufunc_rebuild(decade, signed), map_error(decade, signed), rel_tol=1e-4)
    result = check_dynamic_map_error(map_error_by_numpy_ufunc_rebuild)
    assert not result and "torch or numpy (numpy)" in result.failure, result.failure


def test_decay_ratio_refuses_an_answer_that_switches_the_line_count_off():
    def untraced(w, grad, lr, weight_decay, steps):  # a capped simulation behind sys.settrace(None): the right ratio
        import sys

        sys.settrace(None)
        return decay_ratio_by_simulating(w, grad, lr, weight_decay, steps, cap=200)

    assert_right_by_the_wrong_way(untraced, "sys.settrace")


# -- the count itself: an answer that hides its steps from the grader's count is refused -------------
def assert_right_by_the_wrong_way(fn, name, check=check_decay_ratio, right=None):
    """``fn`` gives the right value (checked on the first cases) and fails by its method, with ``name`` named."""
    cases, reference = (DECAY_CASES[:3], measured_decay_ratio) if check is check_decay_ratio else (MAP_CASES, right)
    for case in cases:
        assert math.isclose(fn(*case), reference(*case), rel_tol=0.05 if right is None else 1e-4), case
    result = check(fn)
    assert not result and name in result.failure, result.failure


def restoring_the_tracer(simulate):
    def answer(*case):  # save the grader's trace function, switch it off, simulate, and put it back
        import sys

        t = sys.gettrace()
        sys.settrace(None)
        try:
            return simulate(*case)
        finally:
            sys.settrace(t)

    return answer


def test_graders_refuse_an_answer_that_switches_the_count_off_and_back_on():
    assert_right_by_the_wrong_way(
        restoring_the_tracer(lambda *case: decay_ratio_by_simulating(*case, cap=200)), "settrace"
    )
    by_scan = restoring_the_tracer(map_error_by_plain_python_scan)
    assert_right_by_the_wrong_way(by_scan, "settrace", check_dynamic_map_error, map_error)

    def by_a_built_name(*case):  # the same, with no name of the trace functions in its code
        import sys

        set_trace = getattr(sys, "".join(["set", "trace"]))
        before = getattr(sys, "".join(["get", "trace"]))()
        set_trace(None)
        try:
            return decay_ratio_by_simulating(*case, cap=200)
        finally:
            set_trace(before)

    assert_right_by_the_wrong_way(by_a_built_name, "sys.settrace")


def decay_ratio_in_a_silent_frame(w, grad, lr, weight_decay, steps, silence):
    """A capped simulation in a frame that ``silence()`` has told to stop reporting its lines: the right ratio."""
    silence()
    out = []
    for wd, coupled in ((0.0, False), (weight_decay, True), (weight_decay, False)):
        p, m, v, t = w, 0.0, 0.0, 0
        while t < min(steps, 200):
            t += 1; g = (grad if t % 2 else -grad) + (wd * p if coupled else 0.0); p -= 0.0 if coupled else lr * wd * p; m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g; p -= lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)) ** 0.5 + 1e-8)  # noqa: E501, E702  # fmt: skip
        out.append(p)
    return (out[0] - out[1]) / (out[0] - out[2])


def silence_the_caller():
    import sys

    sys._getframe(1).f_trace_lines = False


def silence_the_caller_by_built_names():  # the same, with no name of frames or tracing in its code
    import sys

    frame = getattr(sys, "".join(["_get", "frame"]))(1)
    setattr(frame, "".join(["f_trace", "_lines"]), False)


def test_decay_ratio_refuses_an_answer_that_turns_off_its_frames_line_events():
    by_name = lambda *case: decay_ratio_in_a_silent_frame(*case, silence_the_caller)  # noqa: E731
    assert_right_by_the_wrong_way(by_name, "_getframe")
    by_built_names = lambda *case: decay_ratio_in_a_silent_frame(*case, silence_the_caller_by_built_names)  # noqa: E731
    assert_right_by_the_wrong_way(by_built_names, "f_trace_lines")


STEP = (
    "t+=1;g=(grad if t%2 else -grad)+(wd*p if c else 0.0);p-=0.0 if c else lr*wd*p;"
    "m,v=0.9*m+0.1*g,0.999*v+0.001*g*g;p-=lr*(m/(1-0.9**t))/((v/(1-0.999**t))**0.5+1e-8);"
)


def decay_ratio_unrolled(w, grad, lr, weight_decay, steps, run):
    """200 Adam steps written out on one line and run by ``exec``: one line event, the right ratio."""
    out = []
    for wd, c in ((0.0, False), (weight_decay, True), (weight_decay, False)):
        state = dict(w=w, grad=grad, lr=lr, wd=wd, c=c)
        run("p,m,v,t=w,0.0,0.0,0;" + STEP * min(steps, 200), state)
        out.append(state["p"])
    return (out[0] - out[1]) / (out[0] - out[2])


def test_decay_ratio_refuses_a_simulation_unrolled_onto_one_line():
    assert_right_by_the_wrong_way(lambda *case: decay_ratio_unrolled(*case, run=exec), "exec")

    def by_a_built_name(*case):  # exec, not named in the answer's code: only the count of instructions sees it
        import builtins

        return decay_ratio_unrolled(*case, run=getattr(builtins, "".join(["ex", "ec"])))

    assert_right_by_the_wrong_way(by_a_built_name, "instructions")
