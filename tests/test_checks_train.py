"""The graders of lessons 06-08 pass the reference solutions and fail typical mistakes."""

from llmedu.checks.train import check_accumulate, check_adam_state_bytes, check_checkpoint, check_scale_update
from llmedu.memory.estimate import adamw_fp32_bytes, mixed_precision_adam_bytes
from llmedu.train.recompute import checkpoint


def scale_update(scale, clean, found_inf, interval):
    if found_inf:
        return scale / 2, 0
    clean += 1
    return (scale * 2, 0) if clean == interval else (scale, clean)


def accumulate(model, loss_fn, micro_batches):
    for batch in micro_batches:
        (loss_fn(model, batch) / len(micro_batches)).backward()


def test_graders_pass_correct_answers():
    assert check_adam_state_bytes(lambda n, mixed: (mixed_precision_adam_bytes if mixed else adamw_fp32_bytes)(n))
    assert check_scale_update(scale_update)
    assert check_accumulate(accumulate)
    assert check_checkpoint(lambda f, x: checkpoint(f, x))


def test_graders_fail_typical_mistakes(capsys):
    assert not check_adam_state_bytes(lambda n, mixed: {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n})
    assert not check_scale_update(lambda s, c, inf, n: (s / 2, 0) if inf else (s * 2, 0))  # grows every step
    assert not check_accumulate(lambda m, loss_fn, mb: [loss_fn(m, b).backward() for b in mb])  # forgot the 1/k
    assert not check_checkpoint(lambda f, x: f(x))  # right answer, but saves every activation
    assert not check_checkpoint(lambda f, x: f(x).detach())  # cuts the graph
    assert "FAIL check_accumulate" in capsys.readouterr().out


def token_accumulate(model, token_losses, micro_batches):
    total = sum(token_losses(model, b)[1].sum() for b in micro_batches)  # real tokens of the whole step
    for b in micro_batches:
        losses, mask = token_losses(model, b)
        ((losses * mask).sum() / total).backward()


def test_token_accumulate_grader():
    from llmedu.checks.train import check_token_accumulate

    assert check_token_accumulate(token_accumulate)

    def mean_of_means(model, token_losses, micro_batches):  # the pitfall: each micro-batch's own mean / k
        for b in micro_batches:
            losses, mask = token_losses(model, b)
            ((losses * mask).sum() / mask.sum() / len(micro_batches)).backward()

    def padding_counted(model, token_losses, micro_batches):  # divides by every position, padding included
        n = sum(token_losses(model, b)[1].numel() for b in micro_batches)
        for b in micro_batches:
            losses, mask = token_losses(model, b)
            ((losses * mask).sum() / n).backward()

    assert not check_token_accumulate(mean_of_means)
    assert not check_token_accumulate(padding_counted)
