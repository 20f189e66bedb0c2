"""The pipeline's messages pair up by the order they are posted in, as under NCCL, which ignores tags.

NCCL matches the n-th send from rank i to j with the n-th receive on j from i, whatever their tags
(pytorch/pytorch#94819), and runs a rank's sends and receives one after the other in the order it
posted them, unless they are posted together in one ``batch_isend_irecv``: a send waits until its
receive is running. Gloo honours tags and matches each pair and direction on its own queue, so a plain
gloo run shows neither hazard. Here every send and receive goes through a test-only layer that drops the
tag (gloo then pairs messages by posting order alone, as NCCL does) and records what each rank posts,
in batches. Two checks, for every schedule at p=2 and p=4:

* values: the loss and the gradients of one process, with messages paired by order alone;
* no deadlock: ``_drain`` plays the recorded posts with a queue per direction on each rank (its sends
  one batch after the other, its receives likewise; a send and a receive meet when both are in their
  queues' current batch). A pipeline that posts a send ahead of a receive its peer needs first gets
  stuck there. The executor posts a receive before a send at a tie (``message_order``), so NCCL's own
  rule, one queue per rank, would get stuck on it: ``_drain(..., per_direction=False)`` shows where.
  An executor that paired messages by tag (each send and receive alone, in the order of its own
  actions) gets stuck either way. ``_drain`` checks only that the recorded messages pair up consistently:
  that the schedules are free of deadlock rests on ``simulate``'s schedules and on the runs on real processes.

Tolerance 1e-5 in fp32, as in test_parallel_pipeline_parallel.py.
"""

import pytest
import torch
import torch.distributed as dist

from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.gpt import lm_loss
from llmedu.parallel import launch
from llmedu.parallel.pipeline_parallel import Pipeline, PipelineStage, stage_chunks

ATOL = 1e-5
CFG = dict(vocab_size=32, d_model=16, n_layers=8, n_heads=2, max_seq_len=4)  # 8 blocks: p x v = 8 chunks at most
RUNS = [("naive", 4, 1), ("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 1)]


# -- the NCCL model -------------------------------------------------------------------------------------------
def _drain(posts: list[list[list[tuple]]], per_direction: bool = True) -> str | None:
    """Play every rank's batches of (kind, peer, what); None if all complete, else where they got stuck.
    The n-th send from i to j meets the n-th receive on j from i (their ``what`` must agree) once both are
    in their queues' current batch; a batch ends when all of its operations have met. ``per_direction``:
    each rank's sends and its receives are two queues (a batch's sends in one, its receives in the other);
    else one queue per rank, as NCCL runs a rank's operations."""
    count: dict = {}
    queues = []  # per rank: batches of operations (kind, src, dst, n, what), n: the n-th of its direction
    for rank, batches in enumerate(posts):
        queues.append([])
        for batch in batches:
            ops = []
            for kind, peer, what in batch:
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                n = count[(kind, src, dst)] = count.get((kind, src, dst), -1) + 1
                ops.append((kind, src, dst, n, what))
            queues[-1].append(ops)
    if per_direction:  # each rank's queue split in two: its sends' batches, its receives' batches
        queues = [
            [b for b in (list(filter(lambda op: op[0] == k, ops)) for ops in q) if b]
            for q in queues
            for k in ("send", "recv")
        ]
    for kind, src, dst in count:
        if count[(kind, src, dst)] != count.get(("recv" if kind == "send" else "send", src, dst)):
            return f"{src}->{dst}: sends and receives differ in number"
    met = set()
    while any(queues):
        current = {(k, s, d, n): w for q in queues if q for k, s, d, n, w in q[0]}
        for (kind, src, dst, n), what in current.items():
            if kind == "send" and ("recv", src, dst, n) in current:
                if current[("recv", src, dst, n)] != what:
                    return f"send #{n} {src}->{dst} of {what} meets a receive of {current[('recv', src, dst, n)]}"
                met |= {("send", src, dst, n), ("recv", src, dst, n)}
        done = [r for r, q in enumerate(queues) if q and all(op[:4] in met for op in q[0])]
        if not done:
            stuck = {r: [op[:4] for op in q[0] if op[:4] not in met] for r, q in enumerate(queues) if q}
            return f"stuck: each rank waits in its current batch for {stuck}"
        for r in done:
            queues[r].pop(0)
    return None


def test_drain_finds_a_deadlock_and_a_mismatch():
    # both send first, each its own batch: each send waits for a receive queued behind the other's send
    one_queue = [[[("send", 1, 4)], [("recv", 1, 4)]], [[("send", 0, 4)], [("recv", 0, 4)]]]
    assert "stuck" in _drain(one_queue, per_direction=False)
    assert _drain(one_queue) is None  # a queue per direction: the sends do not wait behind the receives
    # the same in one batch each (batch_isend_irecv): fine
    assert _drain([[[("send", 1, 4), ("recv", 1, 4)]], [[("recv", 0, 4), ("send", 0, 4)]]]) is None
    # sizes 4 and 8 sent, received as 8 and 4: paired by order, the first send meets the wrong receive
    assert "meets" in _drain([[[("send", 1, 4)], [("send", 1, 8)]], [[("recv", 0, 8), ("recv", 0, 4)]]])


# -- every schedule on real processes, tags dropped ------------------------------------------------------------
def _drop_tags_and_record() -> list[list[tuple]]:
    """From now on this process's sends and receives drop their tag and are recorded: a list of batches of
    (kind, peer, number of elements), one batch per ``batch_isend_irecv`` or lone send/receive."""
    c10d = dist.distributed_c10d
    real = {name: getattr(c10d, name) for name in ("isend", "irecv", "batch_isend_irecv")}  # send, recv call these
    posts, batching = [], []

    def point_to_point(name, kind):
        def op(tensor, peer=None, group=None, tag=0, **kwargs):  # peer: dst or src, by position or name
            peer = next(p for p in (peer, *kwargs.values()) if p is not None)
            (posts[-1] if batching else posts.append([]) or posts[-1]).append((kind, peer, tensor.numel()))
            return real[name](tensor, peer, group, tag=0)  # tag dropped: paired by posting order alone

        return op

    def batch_isend_irecv(ops):
        posts.append([])
        batching.append(True)
        try:
            return real["batch_isend_irecv"](ops)
        finally:
            batching.pop()

    wrapped = {"isend": point_to_point("isend", "send"), "irecv": point_to_point("irecv", "recv")}
    wrapped["batch_isend_irecv"] = batch_isend_irecv
    for name, fn in wrapped.items():  # P2POp checks its op against distributed_c10d's own names
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    return posts


def _every_schedule() -> dict:
    torch.set_num_threads(1)
    posts = _drop_tags_and_record()
    rank, p = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, CFG["vocab_size"], (8, CFG["max_seq_len"]), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    oracle = CausalLM(TransformerConfig(**CFG))
    oracle_loss = lm_loss(oracle(ids), ids)
    oracle_loss.backward()
    full = dict(oracle.named_parameters(remove_duplicate=False))  # lm_head.weight too: tied
    out = {}
    for name, m, v in RUNS:
        del posts[:]
        torch.manual_seed(0)
        chunks = stage_chunks(CausalLM(TransformerConfig(**CFG)), rank, p, v)
        loss = Pipeline(chunks, list(range(p)), lm_loss, lambda x: (*x.shape, CFG["d_model"])).step(ids, ids, m, name)
        out[name] = {
            "grad": max(
                (q.grad - full[PipelineStage.full_name(n)].grad).abs().max().item()
                for c in chunks
                for n, q in c.named_parameters()
            ),
            "loss": None if loss is None else abs(loss.item() - oracle_loss.item()),
            "posts": [list(batch) for batch in posts],
        }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["p=2", "p=4"])
def ranks(request):
    return request.param, launch(_every_schedule, request.param, echo=False)


@pytest.mark.parametrize("name", [run[0] for run in RUNS])
def test_tags_ignored_every_schedule_gives_the_loss_and_gradients_of_one_process(ranks, name):
    p, results = ranks
    for rank, result in enumerate(results):
        assert result[name]["grad"] < ATOL, f"p={p} rank {rank}: {name} gradients off by {result[name]['grad']:.2e}"
    assert results[-1][name]["loss"] < ATOL, f"p={p}: {name} loss off by {results[-1][name]['loss']:.2e}"


@pytest.mark.parametrize("name", [run[0] for run in RUNS])
def test_every_pair_of_ranks_posts_its_messages_in_one_order(ranks, name):
    p, results = ranks
    stuck = _drain([result[name]["posts"] for result in results])
    assert stuck is None, f"p={p} {name}: a queue per direction would hang or pair the wrong messages: {stuck}"


def test_every_schedule_posts_in_an_order_that_completes_with_a_queue_per_direction(monkeypatch):
    """The executor's sends and receives, in its order of actions, through ``Mailbox`` with the posts
    recorded instead of sent: for p up to 4, m up to 8, v up to 3, every message meets the right one
    with a queue per direction on each rank."""
    from llmedu.parallel import p2p
    from llmedu.parallel.pipeline_schedules import Message, message_order, schedule

    class Done:
        def wait(self):
            pass

    named = {}  # id of a tensor -> (tensor, the message it is the buffer or the payload of)

    def tensor_of(message):
        t = torch.empty(0)
        named[id(t)] = (t, message)
        return t

    def record(sends, recvs):  # in place of p2p.post: the batch, with each tensor's message
        posts[-1].append([("recv", peer, named[id(b)][1]) for b, peer in recvs])
        posts[-1][-1] += [("send", peer, named[id(t)][1]) for t, peer in sends]
        return [Done() for _ in recvs + sends]

    monkeypatch.setattr(p2p, "post", record)
    for p in (2, 3, 4):
        for m in range(1, 9):
            cases = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)]
            cases += [("interleaved", v) for v in (1, 2, 3) if m % p == 0]
            for name, v in cases:
                posts, last = [], p * v - 1
                for r in range(p):
                    posts.append([])
                    mail = p2p.Mailbox(message_order(name, m, p, r, v), new_buffer=tensor_of)
                    for a in schedule(name, m, p, r, v):  # the calls Pipeline.step makes, in its order
                        g, forward = a.chunk * p + r, a.kind == "F"
                        if (forward and g > 0) or (a.kind in "BI" and g < last):
                            mail.recv(Message(a.micro, g, grad=not forward))
                        if (forward and g < last) or (a.kind in "BI" and g > 0):
                            message = Message(a.micro, g + 1 if forward else g - 1, grad=not forward)
                            mail.send(message, tensor_of(message))
                    mail.wait_for_sends()
                assert _drain(posts) is None, (name, p, m, v, _drain(posts))
                if (name, p, m, v) == ("interleaved", 2, 2, 2):  # one queue per rank: receives first at a tie hang
                    assert "stuck" in _drain(posts, per_direction=False)


# -- ranks that cut the step differently -----------------------------------------------------------------------
def _different_micro_batches() -> str:
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, CFG["vocab_size"], (8, CFG["max_seq_len"]), generator=torch.Generator().manual_seed(3))
    stage = PipelineStage(CausalLM(TransformerConfig(**CFG)), rank, p)
    pipe = Pipeline(stage, list(range(p)), lm_loss, lambda x: (*x.shape, CFG["d_model"]))
    try:
        pipe.step(ids, ids, 2 if rank == 0 else 4, "1f1b")  # rank 0 cuts 2 micro-batches, rank 1 cuts 4
    except ValueError as err:
        return str(err)
    return "no error"


def test_ranks_that_cut_different_numbers_of_micro_batches_are_told_each_count():
    for message in launch(_different_micro_batches, 2, echo=False):
        assert "rank 0: n_micro=2; rank 1: n_micro=4" in message, message
        assert "same batch size, n_micro and schedule on every rank" in message
