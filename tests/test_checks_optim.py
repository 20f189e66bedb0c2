"""check_adamw_step passes a correct AdamW step and fails (and names) the usual mistakes."""

from llmedu.checks.optim import check_adamw_step


def adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """A learner's textbook answer: the paper's algebra, not torch's order of operations."""
    param = param - lr * weight_decay * param
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    return param - lr * m_hat / (v_hat.sqrt() + eps), m, v


def no_bias_correction(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    param = param - lr * weight_decay * param
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    return param - lr * m / (v.sqrt() + eps), m, v


def l2_coupled(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    grad = grad + weight_decay * param  # Adam with L2 regularisation
    return adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, 0.0)


def decay_after(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    param, m, v = adamw_step(param, grad, m, v, step, lr, beta1, beta2, eps, 0.0)
    return param * (1 - lr * weight_decay), m, v


def in_place(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """Updating the inputs in place, torch style, is fine too."""
    param.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
    return param, m, v


def eps_before_bias_correction(param, grad, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """Kingma & Ba's 'efficient' form: alpha_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t), eps added to sqrt(v)."""
    param = param - lr * weight_decay * param
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad**2
    alpha_t = lr * (1 - beta2**step) ** 0.5 / (1 - beta1**step)
    return param - alpha_t * m / (v.sqrt() + eps), m, v


def test_passes_correct_answers():
    assert check_adamw_step(adamw_step)
    assert check_adamw_step(in_place)


def test_fails_typical_mistakes_with_a_hint(capsys):
    for wrong, name in [
        (no_bias_correction, "no bias correction"),
        (l2_coupled, "coupled"),
        (decay_after, "after"),
        (eps_before_bias_correction, "eps before bias correction"),
    ]:
        result = check_adamw_step(wrong)
        assert not result
        assert f"matches the mistake '{name}'" in result.failure, result.failure
    assert "FAIL check_adamw_step" in capsys.readouterr().out


def test_reports_errors_and_wrong_return_types():
    def crashes(*args):
        raise ZeroDivisionError("oops")

    result = check_adamw_step(crashes)
    assert not result and "ZeroDivisionError" in result.failure
    result = check_adamw_step(lambda p, *args: p)  # returns only the parameter
    assert not result and "return a tuple" in result.failure
    result = check_adamw_step(lambda p, g, m, v, *args: (p, m, v))  # no update at all
    assert not result and "new_param" in result.failure


def test_decay_after_is_caught_only_by_the_large_rate_case():
    """The difference is lr^2 * wd * update: 5e-3 at lr 0.1, wd 0.5; below tolerance at lr 1e-3 and no decay."""
    result = check_adamw_step(decay_after)
    assert "lr=0.1" in result.failure and "weight_decay=0.5" in result.failure


def test_eps_before_bias_correction_is_caught_only_by_the_tiny_gradient_case():
    """With |g| >> eps the two forms agree to fp32 rounding; with |g| ~ eps the effective eps is 32x larger."""
    result = check_adamw_step(eps_before_bias_correction)
    assert "shape (6,)" in result.failure and "step=1," in result.failure
