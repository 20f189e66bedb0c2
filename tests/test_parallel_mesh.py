"""3D layouts train exactly like one process: the same losses, step after step, on real text.

The oracle is the plainest loop there is (one CausalLM, full batch, SGD, ``lm_loss``) run in the
test process; four layouts run one after the other on one world of 8 real processes. Tolerance
1e-4 on losses of ~5.5 over 3 SGD steps (the oracle's falls by 1.0 in them): the layouts only reorder
float sums (TP partial sums, micro-batch and DP gradient sums), ~1e-7 relative per step; a replica
missing from the DP mean or a wrong micro-batch scale moves the loss by 1e-2 after one step, so two
updates show it as well as four (each step costs 8 processes on 2 cores, most of all DP=8's
all-reduce of every parameter).
"""

import pytest
import torch
from raised import raised

from llmedu.data.corpora import load_corpus
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.parallel import launch
from llmedu.parallel.mesh import byte_batches, make_mesh, rank_of, train_3d

STEPS, BATCH, SEQ, LR, ATOL = 3, 8, 16, 0.5, 1e-4
CONFIG = TransformerConfig(vocab_size=256, d_model=32, n_layers=4, n_heads=4, max_seq_len=SEQ, activation="gelu_tanh")


@pytest.fixture(scope="module")
def batches():
    return byte_batches(load_corpus("shakespeare")[:200_000], BATCH, SEQ, STEPS)


@pytest.fixture(scope="module")
def one_process_losses(batches):
    torch.manual_seed(0)
    model = CausalLM(CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = lm_loss(model(ids), ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


LAYOUTS = [(2, 2, 2), (1, 4, 2), (2, 1, 4), (8, 1, 1)]  # (DP, TP, PP), all on one world of 8


def _layouts_worker(batches):
    torch.set_num_threads(1)
    errors = raised(*(lambda sizes=sizes: make_mesh(*sizes) for sizes in ((3, 1, 1), (2, 2, 1), (0, 8, 1))))
    n_micro = lambda dp: 1 if dp == 8 else 2  # noqa: E731  (a batch of 8 over 8 replicas: one row each)
    return {sizes: train_3d(CONFIG, batches, *sizes, n_micro=n_micro(sizes[0]), lr=LR) for sizes in LAYOUTS}, errors


@pytest.fixture(scope="module")
def eight_ranks(batches):
    return launch(_layouts_worker, 8, batches, echo=False)  # one start-up for every layout


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "DP={} x TP={} x PP={}".format(*s))
def test_layout_matches_one_process(eight_ranks, one_process_losses, sizes):
    assert one_process_losses[-1] < one_process_losses[0] - 0.1, f"the oracle did not learn: {one_process_losses}"
    for rank, (runs, _) in enumerate(eight_ranks):
        losses = runs[sizes]
        assert len(losses) == STEPS
        for step, (a, b) in enumerate(zip(losses, one_process_losses)):
            assert abs(a - b) < ATOL, f"{sizes} rank {rank} step {step}: loss {a:.6f}, one process {b:.6f}"


def test_mesh_sizes_that_do_not_make_the_world_fail_at_set_up(eight_ranks):
    messages = eight_ranks[0][1]
    assert len(messages) == 3, messages
    assert "3 x 1 x 1 = 3 is not the world size 8" in messages[0]
    assert "2 x 2 x 1 = 4 is not the world size 8" in messages[1]
    assert "dp must be a positive int" in messages[2]


def test_rank_layout_puts_tensor_parallel_neighbours_together():
    sizes = (2, 2, 2)  # (DP, TP, PP)
    assert [rank_of(0, t, 0, sizes) for t in range(2)] == [0, 1]
    assert [rank_of(d, 0, 0, sizes) for d in range(2)] == [0, 2]
    assert [rank_of(0, 0, p, sizes) for p in range(2)] == [0, 4]
    assert sorted(rank_of(d, t, p, sizes) for d in range(2) for t in range(2) for p in range(2)) == list(range(8))


def test_byte_batches_draw_every_window_start_the_last_one_included():
    text = "abcdefghijklmnopq"  # 17 bytes: windows of 16 start at 0 or 1
    starts = {int(b[0, 0]) - ord("a") for b in byte_batches(text, batch=4, seq_len=16, steps=50, seed=0)}
    assert starts == {0, 1}  # 200 draws: both starts appear (each is missed with probability 2^-200)
    (exact,) = byte_batches(text[:16], batch=3, seq_len=16, steps=1)  # exactly seq_len bytes: one window
    assert exact.shape == (3, 16) and bytes(exact[0].tolist()).decode() == text[:16]
    with pytest.raises(ValueError, match="a text of 15 bytes is too short for windows of 16"):
        byte_batches(text[:15], batch=1, seq_len=16, steps=1)
