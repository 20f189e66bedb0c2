"""Sends between stages over a link of known latency: what overlap hides, in the model and on processes;
and a float64 pipeline whose loss is that of one process to float64 rounding.

The model (``simulate`` with a latency per message) has closed forms for GPipe with equal stages
(t_b = 2 t_f, c per message): overlapped sends add 2(p-1)c to the step (the ramp-up and the drain
cross p-1 links each); blocking sends 2(m+p-2)c. On processes the stages sleep (``SleepStage``), so
the times hold on a shared machine up to Python's overhead; the tolerances below are a few ms per
action, far below the c = 20 ms a message takes; each measured step is compared with the free step of
the same run, which carries the same overhead.
"""

import statistics

import pytest
import torch

from llmedu.parallel import launch
from llmedu.parallel.pipeline_schedules import schedule, simulate
from llmedu.parallel.pipeline_study import gather, loss_gaps, message_seconds, posted_late, time_steps


@pytest.mark.parametrize("p, m, c", [(4, 8, 0.25), (2, 3, 0.5), (3, 6, 1.0)])
def test_gpipe_with_latency_matches_its_closed_forms(p, m, c):
    per_rank = [schedule("gpipe", m, p, r) for r in range(p)]
    overlapped = max(e["end"] for e in simulate(per_rank, latency=c))
    blocking = simulate(per_rank, latency=c, blocking=True)
    assert overlapped == pytest.approx(3 * (m + p - 1) + 2 * (p - 1) * c)
    assert max(e["end"] for e in blocking) == pytest.approx(3 * (m + p - 1) + 2 * (m + p - 2) * c)
    sends = [e for e in blocking if e["lane"] == "comm"]
    assert len(sends) == 2 * m * (p - 1)  # each micro-batch crosses p-1 links forward and back


def test_simulate_takes_a_duration_per_rank_and_refuses_a_wrong_count():
    slow = [{}, {"F": 2.0, "B": 4.0}]  # stage 1 twice as slow: GPipe's step is 3((m-1)2 + 1 + 2)
    assert max(e["end"] for e in simulate([schedule("gpipe", 3, 2, r) for r in range(2)], slow)) == 21.0
    with pytest.raises(ValueError, match="2 ranks"):
        simulate([schedule("gpipe", 3, 2, r) for r in range(2)], [{}])


T_F, ALPHA, P, M, REPEATS = 0.04, 0.02, 4, 6, 5  # stages of 40 ms forward; 20 ms per message
EPS = 0.005  # a receive posted this long after its message was sent still counts as in time


def _free_overlap_blocking():
    torch.set_num_threads(1)
    link = (ALPHA, 1e9)
    runs = {
        mode: time_steps("gpipe", M, T_F, REPEATS, link=link, overlap=mode == "overlap")
        for mode in ("overlap", "blocking")
    }
    return runs | {"free": time_steps("gpipe", M, T_F, REPEATS)}


@pytest.mark.alone  # times the schedule against the link model
def test_sends_over_a_link_cost_what_the_model_says_and_no_receive_is_posted_late():
    """p=4, where a receive posted late shows: GPipe's backward has rank s send the gradient of B_i as rank
    s+1 sends that of B_(i+1); a Mailbox that posted that receive only with its send (ties broken the lower
    rank's send first) posted it a backward late, and every message reached rank p-2 a link time late:
    (m-1)c = 100 ms on the step. Measured steps carry Python's overhead per action, so each is compared with
    the free step of the same run: the link must add the model's 2(p-1)c overlapped and 2(m+p-2)c blocking,
    within (m-1)c / 2 = 50 ms, half the late receives' cost: wide enough for a median of 5 steps on a
    machine loaded several processes per core (the link's threads wake late there), narrow enough to fail
    them. And no receive is posted more than EPS after its message was sent, in the median step: in order,
    each is posted about t_f - c = 20 ms before or earlier (the Mailbox posts the receives up to its next
    send: one forward ahead; a load delay below that cannot make one late), out of order a backward after."""
    per_rank = launch(_free_overlap_blocking, P, echo=False)
    c = message_seconds(ALPHA, 1e9)
    step = {mode: statistics.median(gather([r[mode] for r in per_rank])[0]) for mode in ("free", "overlap", "blocking")}
    late = [max(posted_late([r["overlap"] for r in per_rank], i).values()) for i in range(REPEATS)]
    assert statistics.median(late) < EPS, f"receives posted up to {[round(x * 1e3, 1) for x in late]} ms late"
    tol = (M - 1) * c / 2
    added = {mode: step[mode] - step["free"] for mode in ("overlap", "blocking")}
    model = {"overlap": 2 * (P - 1) * c, "blocking": 2 * (M + P - 2) * c}
    for mode in ("overlap", "blocking"):
        assert abs(added[mode] - model[mode]) < tol, (mode, added, model, step)
    blocked = [e for e in per_rank[0]["blocking"]["events"][0] if e["label"].startswith("send")]
    assert len(blocked) == M  # blocking: rank 0 waits once per activation it sends


CFG = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=8)


def _gaps():
    torch.set_num_threads(1)
    return loss_gaps("1f1b", 3, 4, torch.float64, CFG)


def test_a_float64_pipeline_trains_as_one_process_to_float64_rounding():
    gaps = launch(_gaps, 2, echo=False)[1]["gaps"]  # the last rank compares
    assert len(gaps) == 4 and max(gaps) < 1e-12, gaps  # a float32 loss inside the pipeline would be ~1e-7 off
