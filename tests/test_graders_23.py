"""Lesson 23's graders against the ways round them: a Wanda mask scored by the wrong quantity or axis, a
gradient by finite differences, a high-temperature limit by extrapolating the loss from two large T. Each
bypass gives the right numbers (the tests check that too), so only the method check can fail it."""

import math
import threading

import numpy as np
import torch

from llmedu.checks.compress import (
    _cosine_cases,
    _wanda_cases,
    check_cosine_gradient,
    check_high_temperature_limit,
    check_wanda_mask,
    high_temperature_limit,
)
from llmedu.compress.distillation import hidden_state_loss
from llmedu.compress.pruning import nm_mask


# -- exercise 1: Wanda's 2:4 mask --------------------------------------------------------------------------------
def _two_four(score):
    """Keep the 2 largest of each group of 4 consecutive inputs of ``score`` (out, in), by hand."""
    out, inp = score.shape
    groups = score.reshape(out, inp // 4, 4)  # (out, in/4, 4)
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, -1).indices, True)
    return keep.reshape(out, inp)


def test_wanda_mask_passes_the_criterion_written_two_ways():
    assert check_wanda_mask(lambda w, x: _two_four(w.abs() * x.norm(dim=0)))
    assert check_wanda_mask(lambda w, x: nm_mask(w.abs() * x.pow(2).sum(0).sqrt()).float())  # a 0/1 mask


def test_wanda_mask_fails_magnitude_and_the_wrong_axis():
    assert not check_wanda_mask(lambda w, x: nm_mask(w))  # plain magnitude: the inputs ignored
    # the norm over features (one per token) instead of over tokens (one per feature): it broadcasts where
    # n_tokens equals in_features (or out_features, as a row scale that leaves each row's order alone)
    assert not check_wanda_mask(lambda w, x: _two_four(w.abs() * x.norm(dim=1)))
    assert not check_wanda_mask(lambda w, x: _two_four(w.abs() * x.norm(dim=1)[: w.shape[0], None]))
    assert not check_wanda_mask(lambda w, x: _two_four(w.abs() * x.norm(dim=0) ** 2))  # the squared norm
    assert not check_wanda_mask(lambda w, x: _two_four(w.abs() * x.abs().mean(0)))  # the mean size, not the l2 norm
    # Wanda's score, grouped along the outputs (down a column) instead of the inputs
    assert not check_wanda_mask(
        lambda w, x: _two_four((w.abs() * x.norm(dim=0)).T.contiguous()).T if w.shape[0] % 4 == 0 else None
    )


def test_wanda_cases_make_magnitude_and_wanda_differ_in_every_shape():
    for name, w, x in _wanda_cases(torch.Generator().manual_seed(4)):
        assert not torch.equal(nm_mask(w), nm_mask(w.abs() * x.norm(dim=0))), name


# -- exercise 2: the cosine gradient by the derivation ------------------------------------------------------------
def _cosine(s, t):
    s_norm, t_norm = s.norm(dim=-1, keepdim=True), t.norm(dim=-1, keepdim=True)  # (B, T, 1)
    cos = (s * t).sum(-1, keepdim=True) / (s_norm * t_norm)
    return -(t / t_norm - cos * s / s_norm) / (s_norm * s.shape[0] * s.shape[1])


def _fd_through_loss(s, t, h=1e-6):
    """Central differences of ``hidden_state_loss`` in float64, one entry of s at a time."""
    s64, t64 = s.double(), t.double()
    flat, grad = s64.reshape(-1), torch.zeros(s.numel(), dtype=torch.float64)
    for i in range(flat.numel()):
        up, down = flat.clone(), flat.clone()
        up[i] += h
        down[i] -= h
        loss_up, loss_down = hidden_state_loss(up.reshape(s.shape), t64), hidden_state_loss(down.reshape(s.shape), t64)
        grad[i] = (loss_up - loss_down) / (2 * h)
    return grad.reshape(s.shape).float()


def _fd_by_coordinate(s, t, h=1e-6):
    """Central differences of the per-token loss, written out, one coordinate of every token at a time."""
    s64, t64 = s.double(), t.double()

    def per_token(x):  # (B, T): 1 - cos
        return 1 - (x * t64).sum(-1) / (x.norm(dim=-1) * t64.norm(dim=-1))

    columns = []
    for k in range(s.shape[-1]):
        step = torch.zeros(s.shape[-1], dtype=torch.float64)
        step[k] = h
        columns.append((per_token(s64 + step) - per_token(s64 - step)) / (2 * h * s.shape[0] * s.shape[1]))
    return torch.stack(columns, -1).float()


def test_the_finite_differences_give_the_right_numbers():
    for name, s, t in _cosine_cases(torch.Generator().manual_seed(2)):
        leaf = s.clone().requires_grad_()
        (expected,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
        for fd in (_fd_through_loss, _fd_by_coordinate):
            assert torch.allclose(fd(s, t), expected, atol=1e-6, rtol=1e-4), (name, fd.__name__)


def test_cosine_gradient_fails_finite_differences():
    assert check_cosine_gradient(_cosine)
    assert check_cosine_gradient(  # the cosine from torch, at the given states, is a right method
        lambda s, t: (
            -(
                t / t.norm(dim=-1, keepdim=True)
                - torch.nn.functional.cosine_similarity(s, t, dim=-1)[..., None] * s / s.norm(dim=-1, keepdim=True)
            )
            / (s.norm(dim=-1, keepdim=True) * s.shape[0] * s.shape[1])
        )
    )
    assert not check_cosine_gradient(_fd_through_loss)
    assert not check_cosine_gradient(_fd_by_coordinate)


# -- exercise 3: the high-temperature limit, derived -------------------------------------------------------------
def _kl_numpy(s, t, T):
    def log_softmax(z):
        z = z / T
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    log_p, log_q = log_softmax(t), log_softmax(s)
    return T**2 * (np.exp(log_p) * (log_p - log_q)).sum(-1).mean()


def _richardson_numpy(s, t):  # the loss at T = 1000 and 2000, its 1/T term cancelled
    s, t = s.numpy(), t.numpy()
    return torch.tensor(2 * _kl_numpy(s, t, 2000.0) - _kl_numpy(s, t, 1000.0))


def _kl_python(rows_s, rows_t, T):
    total = 0.0
    for zs, zt in zip(rows_s, rows_t):
        log_zs = math.log(sum(math.exp(z / T) for z in zs))
        log_zt = math.log(sum(math.exp(z / T) for z in zt))
        total += sum(math.exp(b / T - log_zt) * ((b / T - log_zt) - (a / T - log_zs)) for a, b in zip(zs, zt))
    return T**2 * total / len(rows_s)


def _richardson_items(s, t):  # element by element through .item(), then math
    rows_s = [[s[i, j].item() for j in range(s.shape[1])] for i in range(s.shape[0])]
    rows_t = [[t[i, j].item() for j in range(t.shape[1])] for i in range(t.shape[0])]
    return torch.tensor(2 * _kl_python(rows_s, rows_t, 2000.0) - _kl_python(rows_s, rows_t, 1000.0))


def _richardson_tolist_numpy(s, t):  # out of torch by tolist, then numpy's exp and log
    s, t = np.array(s.tolist()), np.array(t.tolist())
    return torch.tensor(2 * _kl_numpy(s, t, 2000.0) - _kl_numpy(s, t, 1000.0))


def test_the_extrapolations_give_the_right_numbers():
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(5, 4, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    for bypass in (_richardson_numpy, _richardson_items, _richardson_tolist_numpy):
        assert math.isclose(bypass(s, t).item(), high_temperature_limit(s, t).item(), rel_tol=1e-6), bypass.__name__


def test_high_temperature_limit_fails_an_extrapolated_loss():
    assert check_high_temperature_limit(high_temperature_limit)
    assert check_high_temperature_limit(lambda s, t: high_temperature_limit(s, t).item())  # a float is fine
    assert not check_high_temperature_limit(_richardson_numpy)
    assert not check_high_temperature_limit(_richardson_items)
    assert not check_high_temperature_limit(_richardson_tolist_numpy)


# -- the routes round the method checks that a first version of the graders let through ---------------------------
def _fd_all_at_once(s, t, h=1e-6):
    """Central differences of every coordinate at once: s ± h·eye(d) broadcast to (B, T, d, d), the cosine by
    hand, so the number of torch calls does not grow with d and no cosine_similarity is called."""
    s64, t64 = s.double(), t.double()
    step = torch.eye(s.shape[-1], dtype=torch.float64) * h  # (d, d): row k moves coordinate k

    def per_token(x):  # (B, T, d, d) -> (B, T, d): 1 - cos of each perturbed copy
        tt = t64[..., None, :]
        return 1 - (x * tt).sum(-1) / (x.norm(dim=-1) * tt.norm(dim=-1))

    up, down = per_token(s64[..., None, :] + step), per_token(s64[..., None, :] - step)
    return ((up - down) / (2 * h * s.shape[0] * s.shape[1])).float()


def test_the_vectorised_finite_difference_gives_the_right_numbers_and_fails():
    for name, s, t in _cosine_cases(torch.Generator().manual_seed(2)):
        leaf = s.clone().requires_grad_()
        (expected,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
        assert torch.allclose(_fd_all_at_once(s, t), expected, atol=1e-6, rtol=1e-4), name
    result = check_cosine_gradient(_fd_all_at_once)
    assert not result and "(..., d, d)" in str(result), result


def _kl_torch(s, t, T, exp, log):
    """T^2 KL(softmax(t/T) || softmax(s/T)) in torch, with the exponential and logarithm given."""

    def log_softmax(z):
        z = z / T
        z = z - z.max(-1, keepdim=True).values
        return z - log(exp(z).sum(-1, keepdim=True))

    log_p, log_q = log_softmax(t), log_softmax(s)
    return T**2 * (exp(log_p) * (log_p - log_q)).sum(-1).mean()


def _richardson(kl):
    return lambda s, t: 2 * kl(s, t, 2000.0) - kl(s, t, 1000.0)


LN2 = math.log(2.0)
_richardson_exp2 = _richardson(  # base-2 exponential and logarithm
    lambda s, t, T: _kl_torch(s, t, T, lambda z: torch.exp2(z / LN2), lambda z: torch.log2(z) * LN2)
)


def _kl_torch_lse(s, t, T):
    def log_softmax(z):  # the log of a sum of exponentials as the last of the cumulative ones
        z = z / T
        return z - torch.logcumsumexp(z, -1)[..., -1:]

    log_p, log_q = log_softmax(t), log_softmax(s)
    return T**2 * ((math.e**log_p) * (log_p - log_q)).sum(-1).mean()  # math.e ** tensor: Tensor.__rpow__


_richardson_rpow_logcumsumexp = _richardson(_kl_torch_lse)


def _richardson_item_numpy(s, t):  # every logit out by .item(), then numpy's exp and log
    s = np.array([[s[i, j].item() for j in range(s.shape[1])] for i in range(s.shape[0])])
    t = np.array([[t[i, j].item() for j in range(t.shape[1])] for i in range(t.shape[0])])
    return torch.tensor(2 * _kl_numpy(s, t, 2000.0) - _kl_numpy(s, t, 1000.0))


_richardson_softplus_pow = _richardson(  # exp(z) as a power with a tensor exponent, log(y) as xlogy(1, y)
    lambda s, t, T: _kl_torch(
        s, t, T, lambda z: torch.pow(torch.full_like(z, math.e), z), lambda y: torch.xlogy(torch.ones_like(y), y)
    )
)


def _assert_right_numbers_refused(bypass, reason):
    gen = torch.Generator().manual_seed(0)
    s, t = (torch.randn(5, 4, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    assert math.isclose(float(bypass(s, t)), high_temperature_limit(s, t).item(), rel_tol=1e-6)
    result = check_high_temperature_limit(bypass)
    assert not result and reason in str(result), result


def test_high_temperature_limit_fails_exp2_and_log2():
    _assert_right_numbers_refused(_richardson_exp2, "exp2")


def test_high_temperature_limit_fails_e_to_the_x_and_logcumsumexp():
    _assert_right_numbers_refused(_richardson_rpow_logcumsumexp, "logcumsumexp")


def test_high_temperature_limit_fails_items_then_numpy():
    _assert_right_numbers_refused(_richardson_item_numpy, ".item() or float() calls")


def test_high_temperature_limit_fails_a_tensor_exponent_and_xlogy():
    _assert_right_numbers_refused(_richardson_softplus_pow, "xlogy")


def test_high_temperature_limit_passes_honest_forms_that_leave_torch_once():
    assert check_high_temperature_limit(lambda s, t: float(high_temperature_limit(s, t)))

    def by_variance(s, t):  # the limit is half the variance, over the classes, of the logit difference
        diff = s - t  # (B, C)
        return (diff.var(-1, unbiased=False) / 2).mean()

    assert check_high_temperature_limit(by_variance)


# -- routes round the method checks that a second version of the graders let through -------------------------------
def _fd_numpy(s, t, h=1e-6):
    """Central differences of the loss in numpy float64, one entry at a time: torch never sees the loss."""
    s64, t64 = s.numpy().astype(np.float64), t.numpy().astype(np.float64)

    def loss(x):
        return (1 - (x * t64).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(t64, axis=-1))).mean()

    grad = np.zeros_like(s64)
    for idx in np.ndindex(s64.shape):
        step = np.zeros_like(s64)
        step[idx] = h
        grad[idx] = (loss(s64 + step) - loss(s64 - step)) / (2 * h)
    return torch.from_numpy(grad).float()


def _in_a_thread(work):
    """``work``'s answer computed in another thread, where a torch function mode (thread-local) does not look."""

    def answer(*args):
        out = []
        worker = threading.Thread(target=lambda: out.append(work(*args)))
        worker.start()
        worker.join()
        return out[0]

    return answer


def _autograd(s, t):
    with torch.enable_grad():
        leaf = s.clone().requires_grad_()
        (grad,) = torch.autograd.grad(hidden_state_loss(leaf, t), leaf)
    return grad


def _assert_right_gradient_refused(bypass, reason):
    for name, s, t in _cosine_cases(torch.Generator().manual_seed(2)):
        assert torch.allclose(bypass(s, t), _autograd(s, t), atol=1e-6, rtol=1e-4), name
    result = check_cosine_gradient(bypass)
    assert not result and reason in str(result), result


def test_cosine_gradient_fails_finite_differences_in_numpy():
    _assert_right_gradient_refused(_fd_numpy, "took numbers out of torch")


def test_cosine_gradient_fails_autograd_in_a_thread():
    _assert_right_gradient_refused(_in_a_thread(_autograd), "starting a thread is refused")


def test_high_temperature_limit_fails_the_loss_in_a_thread():
    _assert_right_numbers_refused(_in_a_thread(_richardson_numpy), "starting a thread is refused")


def _complex_exp(z):  # e^x = cos(ix) - i sin(ix)
    iz = (1j * z).to(torch.complex128)
    return (torch.cos(iz) - 1j * torch.sin(iz)).real


def _complex_log(y):  # log y = 2 atanh(u), u = (y - 1) / (y + 1), and atanh(u) = -i atan(iu)
    u = ((y - 1) / (y + 1)).to(torch.complex128)
    return (-2j * torch.atan(1j * u)).real


def _kl_by_partition_functions(s, t, T, exp, log):
    """T^2 KL from the ratio of the two partition functions, which stays near 1 at large T."""
    e_s, e_t = exp(s / T), exp(t / T)  # (B, C)
    z_s, z_t = e_s.sum(-1, keepdim=True), e_t.sum(-1, keepdim=True)  # (B, 1)
    return (T * T * (e_t / z_t * ((t - s) / T - log(z_t / z_s))).sum(-1)).mean()


def _taylor_exp(u, terms=8):  # sum of u^k / k!: u = logit / T is of order 1e-3
    out, term = torch.ones_like(u), torch.ones_like(u)
    for k in range(1, terms):
        term = term * u / k
        out = out + term
    return out


def _taylor_log(r, terms=4):  # 2 atanh(v) = 2 (v + v^3/3 + ...), v = (r - 1) / (r + 1) of order 1e-3
    v = (r - 1) / (r + 1)
    out, power = torch.zeros_like(v), v
    for k in range(1, 2 * terms, 2):
        out = out + power / k
        power = power * v * v
    return 2 * out


def _richardson_with(exp, log):
    return _richardson(lambda s, t, T: _kl_by_partition_functions(s, t, T, exp, log))


def test_high_temperature_limit_fails_exp_and_log_by_complex_numbers():
    _assert_right_numbers_refused(_richardson_with(_complex_exp, _complex_log), "complex tensors")


def test_high_temperature_limit_fails_exp_and_log_as_taylor_polynomials():
    _assert_right_numbers_refused(_richardson_with(_taylor_exp, _taylor_log), "torch calls, more than 30")


def test_high_temperature_limit_passes_a_long_hand_closed_form():
    def long_hand(s, t):  # every step on its own line, as a learner may write it: still well under the cap
        C = s.shape[-1]
        s_centred = s - s.sum(-1, keepdim=True) / C
        t_centred = t - t.sum(-1, keepdim=True) / C
        diff = s_centred - t_centred  # (B, C)
        per_row = (diff * diff).sum(-1) / (2 * C)  # (B,)
        return float(per_row.sum() / per_row.shape[0])

    assert check_high_temperature_limit(long_hand)
