"""The graders of lessons 06-09 pass the reference solutions and fail typical mistakes."""

import torch
from naive_checkpoint import NaiveCheckpoint

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


# -- lesson 09: the understanding exercises ----------------------------------------------------------
def test_token_weights_grader(capsys):
    from llmedu.checks.train import check_token_weights

    assert check_token_weights(lambda n: [sum(n) / (len(n) * n_i) for n_i in n])
    assert not check_token_weights(lambda n: [len(n) * n_i / sum(n) for n_i in n])  # upside down
    assert "upside down" in capsys.readouterr().out
    assert not check_token_weights(lambda n: [n_i / sum(n) for n_i in n])  # each micro-batch's share of tokens
    assert not check_token_weights(lambda n: [1 / (len(n) * n_i) for n_i in n])  # absolute, not relative


def _best_segment(L, c):
    k = min((k for k in range(1, L + 1) if L % k == 0), key=lambda k: L / k + c * k)
    return k, L / k + c * k


def _segment_of(choose):
    def answer(L, c):
        k = choose(L, c)
        return k, L / k + c * k

    return answer


def test_best_segment_grader(capsys):
    import math

    from llmedu.checks.train import check_best_segment

    assert check_best_segment(_best_segment)
    # ties (12 blocks, c = 1: k = 3 and k = 4 both keep 7) may be broken either way
    assert check_best_segment(
        lambda L, c: max(
            ((k, L / k + c * k) for k in range(1, L + 1) if L % k == 0), key=lambda kp: (-round(kp[1], 9), kp[0])
        )
    )
    capsys.readouterr()
    assert not check_best_segment(_segment_of(lambda L, c: round(math.sqrt(L))))  # Chen et al.'s c = 1 always
    assert "another divisor" in capsys.readouterr().out
    assert not check_best_segment(_segment_of(lambda L, c: max(1, round(math.sqrt(L / c)))))  # need not divide L
    assert "dividing" in capsys.readouterr().out
    assert not check_best_segment(_segment_of(lambda L, c: 1))  # checkpoint every block, always

    def round_then_step_down(L, c):  # the divisor at or below the integer nearest sqrt(L / c)
        k = max(1, round(math.sqrt(L / c)))
        while L % k:
            k -= 1
        return k

    capsys.readouterr()
    assert not check_best_segment(_segment_of(round_then_step_down))  # 26 blocks, c = 0.5: k = 2, not 13
    assert "26 blocks" in capsys.readouterr().out
    assert not check_best_segment(lambda L, c: (_best_segment(L, c)[0], L / _best_segment(L, c)[0] + 1))  # k a = a


def _recompute_ratio(policy, d, s, d_ff, H, H_kv, forward_only=False, kv_heads=None):
    kv = (H_kv if kv_heads is None else kv_heads) * (d // H)
    attention = 2 * (2 * d * d + 2 * d * kv) + 4 * s * d
    block = attention + 2 * 2 * d * d_ff
    again = {"blocks": block, "attention": attention, "core": 4 * s * d}[policy]
    return (block + again) / block if forward_only else (3 * block + again) / (3 * block)


def test_recompute_flops_grader(capsys):
    from llmedu.checks.train import check_recompute_flops

    assert check_recompute_flops(_recompute_ratio)
    # the lesson's counts for its GPT (d_ff = 4d, no GQA): 1.33x, 1.14x at s = h, 1.05x for the core
    assert abs(_recompute_ratio("blocks", 128, 128, 512, 4, 4) - 4 / 3) < 1e-12
    assert round(_recompute_ratio("attention", 128, 128, 512, 4, 4), 2) == 1.14
    assert round(_recompute_ratio("core", 12288, 2048, 49152, 96, 96), 3) == 1.009
    capsys.readouterr()
    assert not check_recompute_flops(lambda *a: _recompute_ratio(*a, forward_only=True))  # blocks: 2x
    assert "forward pass only" in capsys.readouterr().out
    assert not check_recompute_flops(lambda p, d, s, dff, H, Hk: _recompute_ratio(p, d, s, dff, H, Hk, kv_heads=H))
    assert not check_recompute_flops(  # the lesson's GPT formulas, which assume d_ff = 4d and no GQA
        lambda p, d, s, dff, H, Hk: (
            1
            + {"blocks": 24 * d * d + 4 * s * d, "attention": 8 * d * d + 4 * s * d, "core": 4 * s * d}[p]
            / (72 * d * d + 12 * s * d)
        )
    )


_NoReplay = NaiveCheckpoint  # the lesson's buggy checkpoint: dropout draws new masks in backward


class _ReplayNoFork(_NoReplay):  # replays the masks, but leaves the caller's stream rewound
    @staticmethod
    def forward(ctx, f, x):
        ctx.rng = torch.get_rng_state()
        return _NoReplay.forward(ctx, f, x)

    @staticmethod
    def backward(ctx, grad_out):
        torch.set_rng_state(ctx.rng)
        return _NoReplay.backward(ctx, grad_out)


class _Replay(_ReplayNoFork):  # the fix: the same forward, the replay inside fork_rng
    @staticmethod
    def backward(ctx, grad_out):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            return _NoReplay.backward(ctx, grad_out)


def test_checkpoint_rng_grader(capsys):
    import torch.utils.checkpoint as torch_checkpoint

    from llmedu.checks.train import check_checkpoint_rng

    assert check_checkpoint_rng(_Replay.apply)
    assert check_checkpoint_rng(lambda f, x: checkpoint(f, x))  # the library's Recompute
    assert check_checkpoint_rng(lambda f, x: torch_checkpoint.checkpoint(f, x, use_reentrant=False))
    capsys.readouterr()
    assert not check_checkpoint_rng(_NoReplay.apply)
    assert "other dropout masks" in capsys.readouterr().out
    assert not check_checkpoint_rng(_ReplayNoFork.apply)
    assert "caller's random state" in capsys.readouterr().out
    assert not check_checkpoint_rng(lambda f, x: f(x))  # right gradients, but saves every activation
    assert "keep only x" in capsys.readouterr().out
