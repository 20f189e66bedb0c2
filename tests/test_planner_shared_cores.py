"""Ranks that share one CPU (``shared_cores``): the two measured terms, how the cost model charges them,
and the message counts they are charged on, checked against what our wrappers really send."""

import collections
import functools
from dataclasses import replace

import pytest
import torch

from llmedu.parallel.compat import ALL_GATHER, REDUCE_SCATTER  # this torch's names of the two
from llmedu.planner.clusters import Link, cluster
from llmedu.planner.measured import build, small_gpt
from llmedu.planner.memory import Batch, Layout
from llmedu.planner.messages import dp_collectives, hops, messages_per_micro_batch, messages_per_step, tp_collectives
from llmedu.planner.probes import local_cluster
from llmedu.planner.shared_cores import measure_sharing, sharing_from
from llmedu.planner.sharing import Sharing
from llmedu.planner.step_time import step_time

LINK = Link("test link", bandwidth=1e9, latency=1e-4, source="a test")
KNOWN = dict(cores=2, thread_flops=1e10, link=LINK, adam_rate=1e9, memory_bytes=2**34, threads=1)
CFG, BATCH = small_gpt(64, 4, 32), Batch(8, 32)


def machine(world, speed=None, wait=0.0, **changes):
    sharing = None if speed is None else Sharing(world, speed, wait, "a test")
    return local_cluster(world, sharing=sharing, **{**KNOWN, **changes})


def test_the_probe_times_become_a_speed_and_a_wait_per_hop():
    s = sharing_from(4, speed=0.4, message=0.009, modelled=0.003, noise=0.05)
    assert (s.speed, s.wait) == pytest.approx((0.4, 0.001))  # 6 ms over the 6 hops of a 4-rank ring
    assert "40%" in s.source and "+- 5%" in s.source and "6 hops" in s.source
    assert (s.measured, s.noise) == (0.4, 0.05)
    # a message never waits less than nothing
    assert sharing_from(2, 0.9, 0.0005, 0.001).wait == 0.0


def test_a_speed_above_one_is_no_slowdown_within_its_noise_and_refused_beyond_it():
    """Ranks that share a CPU do not speed each other up: a reading of 1.2 +- 0.25 is "no slowdown" (speed 1),
    its raw value and noise kept and said; 1.2 +- 0.05 is a probe the machine's drift spoiled, refused."""
    s = sharing_from(2, 1.2, 0.0005, 0.001, noise=0.25)
    assert (s.speed, s.measured, s.noise) == (1.0, 1.2, 0.25)
    assert "read 120% +- 25%, above 100% within its noise" in s.source
    with pytest.raises(RuntimeError, match=r"read 120% \+- 5% .* faster together than alone beyond its noise"):
        sharing_from(2, 1.2, 0.0005, 0.001, noise=0.05)


def test_a_speed_above_the_cores_share_is_the_share_within_its_noise_and_refused_beyond_it():
    """4 one-thread ranks on 2 cores get at most half their speed alone: the old probe's 57% reading is the
    share (50%) within a noise of 10%, refused with one of 3%; with 8 cores the share is 1 and 57% stands."""
    s = sharing_from(4, 0.57, 0.0005, 0.001, noise=0.10, cores=2)
    assert (s.speed, s.measured, s.noise) == (0.5, 0.57, 0.10)
    assert "keeps 50%" in s.source and "above the ideal share of 2 cores (50%) within its noise" in s.source
    with pytest.raises(RuntimeError, match=r"read 57% \+- 3% .* faster than the ideal share of 2 cores \(50%\)"):
        sharing_from(4, 0.57, 0.0005, 0.001, noise=0.03, cores=2)
    assert sharing_from(4, 0.57, 0.0005, 0.001, noise=0.03, cores=8).speed == 0.57
    assert sharing_from(2, 0.97, 0.0005, 0.001, cores=2).speed == 0.97  # 2 ranks on 2 cores: the share is 1
    with pytest.raises(ValueError, match="cores must be a positive int"):
        sharing_from(4, 0.4, 0.0005, 0.001, cores=0)


@pytest.mark.alone  # the probe times two ranks sharing the cores, so nothing else may share them
def test_the_real_probe_on_two_ranks_reads_a_speed_within_the_cores_share():
    """The probe on 2 real processes of one thread with the cores' bound: it runs, and its speed is a share."""
    s = measure_sharing(CFG, 2, LINK, repeats=3, steps=2, rounds=5, cores=2)
    assert 0 < s.speed <= 1 and s.measured > 0 and "2 one-thread processes" in s.source


def test_a_noisy_sharing_probe_is_repeated_then_refused(monkeypatch):
    """An injected probe: readings above 1 beyond their spread get a second probe with twice the repeats; a
    reading within its noise is kept (clipped to 1, the raw median and half-range recorded); three noisy
    probes in a row are refused."""
    import importlib

    launch_module = importlib.import_module("llmedu.parallel.launch")  # the module, not the function it exports
    noisy, good, within = [1.30, 1.28, 1.33, 1.31, 1.29], [0.55, 0.61, 0.58, 0.60, 0.57], [0.98, 1.04, 1.12, 0.99]
    answers, calls = [noisy, good], []

    def fake_launch(fn, world, cfg, micro_batch, steps, work_n, rounds, repeats, echo):
        calls.append(repeats)
        return [(answers[len(calls) - 1], 1e-3, 4e-3)]  # speeds, a round of work, of work + a 4 KiB all-reduce

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    s = measure_sharing(CFG, 2, LINK, repeats=5)
    assert calls == [5, 10]
    assert (s.speed, s.measured, s.noise) == pytest.approx((0.58, 0.58, 0.03))
    answers[:], calls[:] = [within], []
    s = measure_sharing(CFG, 2, LINK, repeats=5)
    assert calls == [5] and (s.speed, s.measured, s.noise) == pytest.approx((1.0, 1.015, 0.07))
    answers[:], calls[:] = [noisy] * 3, []
    with pytest.raises(RuntimeError, match="faster together than alone beyond its noise"):
        measure_sharing(CFG, 2, LINK, repeats=5, attempts=3)
    assert calls == [5, 10, 20]


def test_a_message_timed_faster_than_no_message_is_probed_again_then_refused(monkeypatch):
    """On a busy machine the matmul alone can read slower than matmul + all-reduce: a negative message time,
    which used to stop the probe (and lesson 14) with sharing_from's ValueError on its inputs. It is noise
    like a speed above the cores': probed again with twice the repeats, and refused after the last attempt."""
    import importlib

    launch_module = importlib.import_module("llmedu.parallel.launch")
    speeds, answers, calls = [0.55, 0.61, 0.58], [(4e-3, 3e-3), (1e-3, 4e-3)], []

    def fake_launch(fn, world, cfg, micro_batch, steps, work_n, rounds, repeats, echo):
        calls.append(repeats)
        return [(speeds, *answers[len(calls) - 1])]  # (speeds, a round of work, of work + a 4 KiB all-reduce)

    monkeypatch.setattr(launch_module, "launch", fake_launch)
    s = measure_sharing(CFG, 2, LINK, repeats=5)
    assert calls == [5, 10] and s.wait >= 0
    answers[:], calls[:] = [(4e-3, 3e-3)] * 3, []
    with pytest.raises(RuntimeError, match=r"1\.00 ms faster than the matmul alone"):
        measure_sharing(CFG, 2, LINK, repeats=5, attempts=3)
    assert calls == [5, 10, 20]


def test_ranks_with_a_core_each_and_no_wait_cost_what_they_did_before():
    """Two ranks on two cores, nothing measured: no shared-cores part, no waits; a measured speed of 1
    and wait of 0 gives the same step; a GPU preset has neither term."""
    lay = Layout(tp=2, micro_batch=8, sequence_parallel=False)
    assumed = step_time(CFG, lay, BATCH, machine(2))
    measured_ideal = step_time(CFG, lay, BATCH, machine(2, speed=1.0, wait=0.0))
    assert assumed["waits"] == 0 and assumed["shared cores"] == 0
    assert measured_ideal == assumed
    gpus = cluster("dgx-a100")
    assert gpus.message_wait == 0 and gpus.shared_speed(8) == 1.0
    assert step_time(CFG, replace(lay, tp=8, micro_batch=1), Batch(1, 32), gpus)["waits"] == 0


def test_the_wait_is_charged_once_per_hop_of_each_blocking_message():
    """Counted by hand from the wrappers (CFG: 4 layers, 8 sequences): TP2 with one micro-batch of 8 sends
    16 + 5 all-reduces of 2 hops; ZeRO-1 over 4 ranks, 5 units: 10 reduce-scatters and all-gathers of 3 hops
    and the norm's all-reduce of 6; ZeRO-3 with 2 micro-batches: 2 x 5 reduce-scatters and 2 x 2 x 5 gathers
    (3 hops) and the norm (6); PP4 with 8 micro-batches: 2 receives in each of 8 + 3 slots."""
    for lay, count in (
        (Layout(tp=2, micro_batch=8, sequence_parallel=False), 21 * 2),
        (Layout(dp=4, zero=1, micro_batch=2), 10 * 3 + 6),
        (Layout(dp=4, zero=3, micro_batch=1), 30 * 3 + 6),
        (Layout(pp=4, micro_batch=1), 2 * 11),
        (Layout(dp=2, micro_batch=4), 2),
    ):
        parts = step_time(CFG, lay, BATCH, machine(lay.world, speed=1.0, wait=1e-3))
        assert parts["waits"] == pytest.approx(count * 1e-3), str(lay)


def test_the_wait_grows_with_the_message_count():
    """More layers: more TP all-reduces; ZeRO-3 gathers every unit in every micro-batch, ZeRO-1 once."""
    waits = lambda cfg, lay: step_time(cfg, lay, BATCH, machine(lay.world, speed=1.0, wait=1e-3))["waits"]  # noqa: E731
    tp = Layout(tp=2, micro_batch=8, sequence_parallel=False)
    assert waits(small_gpt(64, 2, 32), tp) < waits(CFG, tp)
    zero = [waits(CFG, Layout(dp=4, zero=z, micro_batch=1)) for z in (0, 1, 3)]
    assert zero[0] < zero[1] < zero[2]
    slow = step_time(CFG, tp, BATCH, machine(2, speed=1.0, wait=2e-3))
    fast = step_time(CFG, tp, BATCH, machine(2, speed=1.0, wait=1e-3))
    assert slow["total"] - fast["total"] == pytest.approx(fast["waits"])


def test_a_measured_speed_below_one_slows_every_rank_s_work():
    """Two ranks on two cores that keep 60% of their speed when both compute: the step is their work at
    60% plus the all-reduce, where ideal cores would give the work at full speed."""
    lay = Layout(dp=2, micro_batch=4)
    ideal = step_time(CFG, lay, BATCH, machine(2))
    shared = step_time(CFG, lay, BATCH, machine(2, speed=0.6))
    assert shared["total"] == pytest.approx((ideal["compute"] + ideal["optimizer"]) / 0.6 + ideal["dp"])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Sharing(2, 0.0, 0.0, "x"), "speed must be in"),
        (lambda: Sharing(2, 1.5, 0.0, "x"), "speed must be in"),
        (lambda: Sharing(2, 0.5, -1e-3, "x"), "wait must be >= 0"),
        (lambda: Sharing(0, 0.5, 0.0, "x"), "world must be a positive int"),
        (lambda: Sharing(2, 0.5, 0.0, "x", noise=-0.1), "need noise >= 0"),
        (lambda: sharing_from(2, 0.0, 0.01, 0.001), "need a positive speed"),
        (lambda: sharing_from(2, 0.5, 0.01, 0.001, noise=-0.1), "noise >= 0"),
        (lambda: measure_sharing(CFG, 2, LINK, attempts=0), "attempts must be a positive int"),
        (lambda: hops("nccl", Layout()), "unknown kind of message"),
        (lambda: local_cluster(4, sharing=Sharing(2, 0.5, 0.0, "x"), **KNOWN), "measured with 2 ranks"),
        (lambda: step_time(CFG, Layout(dp=2), BATCH, machine(4, speed=0.5)), "has 2 ranks"),
    ],
)
def test_nonsense_is_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _count_messages(cfg, sequences, layouts):
    """On every rank: the blocking messages of one step of each layout, by patching torch.distributed."""
    import torch.distributed as dist

    names = ("all_reduce", REDUCE_SCATTER, ALL_GATHER, "recv")
    tokens = torch.randint(0, cfg.vocab_size, (sequences, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    rows = []
    for lay in layouts:
        step, _, _ = build(cfg, lay, tokens)
        step()  # warm-up
        counts, originals = collections.Counter(), {n: getattr(dist, n) for n in (*names, "batch_isend_irecv")}
        for n, f in originals.items():
            if n != "batch_isend_irecv":
                setattr(dist, n, lambda *a, _n=n, _f=f, **k: (counts.update([_n]), _f(*a, **k))[1])
        irecv, batch = dist.irecv, originals["batch_isend_irecv"]

        # a pipeline posts its receives (with the sends) as one batch (p2p.post): each receive is still waited on.
        # Its step opens with a check that every stage cut the step alike (a few int64 numbers to each other
        # stage): control, not a message the cost model prices, so it is left out of the count.
        def received(ops):
            return sum(op.op is irecv and op.tensor.dtype != torch.int64 for op in ops)

        dist.batch_isend_irecv = lambda ops: (counts.update(["recv"] * received(ops)), batch(ops))[1]
        try:
            step()
        finally:
            for n, f in originals.items():
                setattr(dist, n, f)
        rows.append(sum(counts.values()))
    return rows


@pytest.mark.slow
def test_the_counts_are_what_our_wrappers_send():
    """Blocking collectives and receives of one step on the busiest rank, counted in the real wrappers, equal
    the cost model's count (one micro-batch for the layouts without a pipeline; a pipeline's per micro-batch)."""
    from llmedu.parallel.launch import launch

    cfg, sequences = small_gpt(64, 2, 16), 4
    layouts = [
        Layout(tp=2, micro_batch=4, sequence_parallel=False),
        Layout(dp=2, zero=1, micro_batch=2),
        Layout(dp=2, zero=2, micro_batch=1),  # two micro-batches: a reduce-scatter in each
        Layout(dp=2, zero=3, micro_batch=1),  # and the gathers too
        Layout(dp=2, micro_batch=2),
        Layout(pp=2, micro_batch=1),
    ]
    counted = launch(_count_messages, 2, cfg, sequences, layouts, echo=False, timeout=120)
    for i, lay in enumerate(layouts):
        m = sequences // (lay.dp * lay.micro_batch)
        per_micro = sum(messages_per_micro_batch(cfg, lay).values())
        dp_moves = dp_collectives(cfg, lay, Batch(sequences, cfg.max_seq_len))
        expected = m * per_micro + sum(messages_per_step(dp_moves).values())
        assert max(rank[i] for rank in counted) == expected, str(lay)


def _count_bytes(cfg, sequences, layouts):
    """On every rank: each blocking message of one step of each layout, as {name: [buffer bytes, ...]}, by
    patching torch.distributed (the buffer: an all-reduce's tensor, a reduce-scatter's input, an all-gather's
    output, i.e. the full buffer ``clusters`` prices)."""
    import torch.distributed as dist

    buffer = {"all_reduce": 0, REDUCE_SCATTER: 1, ALL_GATHER: 0, "recv": 0}
    tokens = torch.randint(0, cfg.vocab_size, (sequences, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    rows = []
    for lay in layouts:
        step, _, _ = build(cfg, lay, tokens)
        step()  # warm-up
        sent, originals = collections.defaultdict(list), {n: getattr(dist, n) for n in buffer}

        def spy(*a, _n, _f, **k):
            t = a[buffer[_n]] if len(a) > buffer[_n] else k["input" if _n == REDUCE_SCATTER else "tensor"]
            sent[_n].append(t.numel() * t.element_size())
            return _f(*a, **k)

        for n, f in originals.items():
            setattr(dist, n, functools.partial(spy, _n=n, _f=f))
        try:
            step()
        finally:
            for n, f in originals.items():
                setattr(dist, n, f)
        rows.append(dict(sent))
    return rows


@pytest.mark.slow
def test_the_bytes_the_cost_model_prices_are_what_our_wrappers_send():
    """Every tensor-parallel and data-parallel collective of one step, counted and sized in the real wrappers
    (fp32, as on this machine), equals ``tp_collectives`` and ``dp_collectives``, the lists ``step_time``
    charges: TP's 4 all-reduces a layer (6 with full recomputation) and the vocabulary ends (the embedding's
    and the head's of b s h values, the loss's three of b s fp32 numbers); ZeRO-2/3's reduce-scatter in every
    micro-batch, ZeRO-1's once a step. Sizes agree to the loss's dropped last token and ZeRO's padding."""
    from llmedu.parallel.launch import launch

    cfg, sequences = small_gpt(64, 2, 16), 4
    batch = Batch(sequences, cfg.max_seq_len)
    layouts = [
        Layout(tp=2, micro_batch=4, sequence_parallel=False),
        Layout(tp=2, micro_batch=2, sequence_parallel=False),  # two micro-batches: every slot's messages twice
        Layout(tp=2, micro_batch=4, recompute="full", sequence_parallel=False),  # 2 more all-reduces a layer
        Layout(dp=2, zero=1, micro_batch=1),  # two micro-batches, one reduce-scatter a unit
        Layout(dp=2, zero=2, micro_batch=1),  # two micro-batches: a reduce-scatter a unit in each
        Layout(dp=2, zero=3, micro_batch=1),  # and two gathers a unit in each
        Layout(dp=2, micro_batch=1),  # DDP: one bucket, once a step
    ]
    sent = launch(_count_bytes, 2, cfg, sequences, layouts, echo=False, timeout=120)
    ops = {"all_reduce": "all_reduce", "reduce_scatter": REDUCE_SCATTER, "all_gather": ALL_GATHER}
    for i, lay in enumerate(layouts):
        m = sequences // (lay.dp * lay.micro_batch)
        expected = collections.defaultdict(lambda: [0, 0.0])  # op -> [messages, bytes] in one step
        for n, size in tp_collectives(cfg, lay, batch, v=4).values():
            expected["all_reduce"][0] += m * n
            expected["all_reduce"][1] += m * n * size
        for op, n, size in dp_collectives(cfg, lay, batch, v=4).values():
            expected[ops[op]][0] += n
            expected[ops[op]][1] += n * size
        for rank in sent:
            measured = {op: sizes for op, sizes in rank[i].items() if op != "recv"}
            assert set(measured) == {op for op, (n, _) in expected.items() if n}, str(lay)
            for op, sizes in measured.items():
                n, total = expected[op]
                assert len(sizes) == n, f"{lay}: {op}"
                # the loss sees s - 1 tokens of s; ZeRO pads each unit to a multiple of the ranks
                assert sum(sizes) == pytest.approx(total, rel=0.01), f"{lay}: {op}"
        if lay.tp > 1:  # and the vocabulary ends are there, the loss's three of one fp32 number a token
            loss = [s for s in sent[0][i]["all_reduce"] if s < 4 * cfg.d_model]
            assert len(loss) == 3 * m and set(loss) == {4 * lay.micro_batch * (cfg.max_seq_len - 1)}, str(lay)
