"""Continuous batching over a paged KV cache: many requests of different lengths, one model.

Static batching waits for the longest request of a batch before starting the next batch. Continuous
(iteration-level) batching (Yu et al. 2022, Orca; vLLM's scheduler, Kwon et al. 2023, sec. 4.5)
decides again at every step:

    1. admit waiting requests while the batch has room and the cache has blocks for their prompt;
       prefill each, and fork it into ``n`` sequences that share the prompt's blocks;
    2. if the running sequences need more blocks than are free for this step, preempt the latest
       arrivals (free their blocks; they are recomputed from their tokens when blocks are free);
    3. decode one token for every running sequence;
    4. retire the sequences that reached ``max_new_tokens`` or the end-of-sequence token, and free
       their blocks at once, so that waiting requests can start on the next step.

Every sequence samples from its own seeded generator, exactly as ``llmedu.models.gpt.generate``
does for one sequence, so the tokens do not depend on what else shares the batch.

``reserve`` turns the same loop into a contiguous server for comparison (Kwon et al. 2023, sec. 2.3 and
3; Orca is their baseline): each sequence is admitted only if a slab of ``reserve`` slots (a number, or
``"request"``: its prompt + ``max_new_tokens``; rounded up to whole blocks) still fits in the unreserved
memory, and holds the slab until it finishes. Its tokens still live in blocks, so it is spared the external fragmentation of a real
contiguous cache; only its admission rule differs, which is what decides how many sequences share a step.

Step 3 is one forward pass for every running sequence, whatever their lengths: ``ragged.decode_step`` gives
each row its own position and masks the keys past its own length, as vLLM's model takes a position per token.
A prompt is prefilled in a pass of its own when it is admitted.

Left out: swapping preempted sequences to CPU memory, chunked prefill, and beam search.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .paged_attention import PagedBatch, PagedKVCache
from .ragged import decode_step

__all__ = ["Request", "ContinuousBatcher"]


@dataclass
class Request:
    """A prompt, how many tokens to add, and how to sample them (``temperature=0``: greedy)."""

    prompt: list[int]
    max_new_tokens: int
    n: int = 1  # parallel samples of the same prompt; they share the prompt's KV blocks
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0  # sample j uses a generator seeded with seed + j

    def __post_init__(self):
        if len(self.prompt) < 1 or self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"a request needs a prompt, max_new_tokens >= 1 and n >= 1, got {self}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class _Sequence:
    id: int
    request: int  # index of its request
    sample: int  # which of the request's n samples
    tokens: list[int]  # prompt and generated tokens; the last one is not in the cache yet
    generated: int = 0
    generator: torch.Generator = field(default=None, repr=False)


class ContinuousBatcher:
    """Serves requests with ``model`` (a ``CausalLM``) from a pool of ``num_blocks`` KV blocks."""

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int = 16,
        max_batch: int = 32,
        eos_id: int | None = None,
        reserve: int | str | None = None,
    ):
        if not (reserve is None or reserve == "request" or (isinstance(reserve, int) and reserve > 0)):
            raise ValueError(
                f"reserve must be None (blocks on demand), 'request' or a number of slots, got {reserve!r}"
            )
        self.model, self.max_batch, self.eos_id, self.reserve = model, max_batch, eos_id, reserve
        weight = next(model.parameters())
        self.cache = PagedKVCache.for_model(model.config, num_blocks, block_size, weight.device, weight.dtype)
        self.history: list[dict] = []  # one record per step: the figures a lesson plots
        self.preemptions = 0
        self.request_of: dict[int, int] = {}  # sequence id -> index of its request
        self.reserved = 0  # blocks held by the slabs of running sequences (only with ``reserve``)

    def _slab(self, req: Request) -> int:
        """Blocks a sequence of ``req`` holds from admission to the end, with ``reserve``; 0 without."""
        if self.reserve is None:
            return 0
        slots = len(req.prompt) + req.max_new_tokens if self.reserve == "request" else self.reserve
        return -(-slots // self.cache.block_size)

    def _sample(self, logits: torch.Tensor, req: Request, generator: torch.Generator) -> int:
        """One token from logits (1, vocab), by the same operations as ``generate``."""
        if req.temperature == 0:
            return int(logits.argmax(dim=-1))
        logits = logits / req.temperature
        if req.top_k is not None:
            kth = logits.topk(req.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))

    @torch.no_grad()
    def run(self, requests: list[Request], progress: bool = True, on_step=None) -> list[list[list[int]]]:
        """Generate for every request; returns outputs[request][sample] = the new tokens.

        ``on_step(record)`` is called after every step with that step's figures (running and
        waiting sequences, sequences decoded, blocks in use, slots allocated / filled / logical / held
        (reserved, or allocated without ``reserve``), tokens made, forward passes).
        """
        model, cache = self.model, self.cache
        device = next(model.parameters()).device
        max_pos = model.config.max_seq_len if model.config.position == "learned" else None
        for i, req in enumerate(requests):
            if max_pos is not None and len(req.prompt) + req.max_new_tokens > max_pos:
                raise ValueError(
                    f"request {i}: {len(req.prompt) + req.max_new_tokens} tokens exceed the position table of {max_pos}"
                )
            if req.n > self.max_batch:
                raise ValueError(
                    f"request {i} asks for {req.n} samples, more than max_batch={self.max_batch} sequences in flight"
                )
            admit = -(-len(req.prompt) // cache.block_size) + req.n  # the prompt, and room for each sample to grow
            finish = -(-(len(req.prompt) + req.max_new_tokens) // cache.block_size) + 1  # one sample, to the end
            if max(admit, finish, req.n * self._slab(req)) > cache.allocator.num_blocks:
                raise ValueError(
                    f"request {i} alone needs more than the {cache.allocator.num_blocks} blocks of the cache"
                )
            if isinstance(self.reserve, int) and len(req.prompt) + req.max_new_tokens > self.reserve:
                raise ValueError(
                    f"request {i}: {len(req.prompt) + req.max_new_tokens} tokens exceed a slab of reserve={self.reserve}"
                )
        outputs = [[[] for _ in range(r.n)] for r in requests]
        waiting: deque[list[_Sequence]] = deque()  # groups of sequences that share their tokens
        next_id = 0
        for i, req in enumerate(requests):
            group = [
                _Sequence(next_id + j, i, j, list(req.prompt), 0, torch.Generator().manual_seed(req.seed + j))
                for j in range(req.n)
            ]
            waiting.append(group)
            self.request_of.update({seq.id: i for seq in group})
            next_id += req.n
        running: list[_Sequence] = []  # in order of admission
        total = sum(r.max_new_tokens * r.n for r in requests)
        bar = tqdm(total=total, desc="tokens", disable=not progress)

        def finish_or_keep(seq: _Sequence, token: int, keep: list) -> None:
            seq.tokens.append(token)
            seq.generated += 1
            outputs[seq.request][seq.sample].append(token)
            bar.update(1)
            if seq.generated == requests[seq.request].max_new_tokens or token == self.eos_id:
                cache.free(seq.id)
                self.reserved -= self._slab(requests[seq.request])
            else:
                keep.append(seq)

        step = 0
        while waiting or running:
            made = passes = 0
            # 1. admission and prefill: a group needs its tokens' blocks plus one per sequence to grow
            while waiting:
                group = waiting[0]
                need = -(-len(group[0].tokens) // cache.block_size) + len(group)
                slabs = len(group) * self._slab(requests[group[0].request])  # 0 without ``reserve``
                if len(running) + len(group) > self.max_batch or need > cache.allocator.num_free:
                    break
                if slabs > cache.allocator.num_blocks - self.reserved:
                    break
                waiting.popleft()
                self.reserved += slabs
                first = group[0]
                cache.add(first.id)
                ids = torch.tensor([first.tokens], device=device)  # (1, T)
                logits = model(ids, cache=PagedBatch(cache, [first.id], ids.shape[1]))[:, -1]  # (1, vocab)
                passes += 1
                for seq in group[1:]:
                    cache.fork(first.id, seq.id)  # shares every block of the prompt
                for seq in group:
                    finish_or_keep(seq, self._sample(logits, requests[seq.request], seq.generator), running)
                    made += 1
            if not running and waiting:
                raise RuntimeError("a waiting request does not fit in the free blocks although nothing is running")
            # 2. preempt the latest arrivals (first come, first served) until this step's growth fits
            while sum(cache.blocks_needed(s.id, 1) for s in running) > cache.allocator.num_free:
                victim = running.pop()
                cache.free(victim.id)
                self.reserved -= self._slab(requests[victim.request])  # never needed with ``reserve``
                self.preemptions += 1
                waiting.appendleft([victim])  # recomputed from its tokens when blocks are free again
            # 3. decode one token per running sequence, all of them in one forward pass
            still = []
            if running:
                logits = decode_step(model, cache, [s.id for s in running], [s.tokens[-1] for s in running])  # (B, V)
                passes += 1
                for row, seq in enumerate(running):
                    finish_or_keep(
                        seq, self._sample(logits[row : row + 1], requests[seq.request], seq.generator), still
                    )
                    made += 1
            decoded = len(running)
            running = sorted(still, key=lambda s: s.id)  # 4. the finished ones are gone
            record = {
                "step": step,
                "running": len(running),
                "waiting": sum(map(len, waiting)),
                "decoded": decoded,  # sequences that took a decoding step together
                "tokens": made,  # the decoded ones, and one more for each sequence admitted (from its prompt)
                "passes": passes,  # forward passes of the model this step
                "preemptions": self.preemptions,
                "blocks_used": cache.allocator.num_used,
                "lengths": dict(cache.lengths),
                **cache.slots(),
            }
            record["held"] = self.reserved * cache.block_size if self.reserve else record["allocated"]
            self.history.append(record)
            if on_step is not None:
                on_step(record)
            step += 1
        bar.close()
        cache.allocator.check()
        return outputs
