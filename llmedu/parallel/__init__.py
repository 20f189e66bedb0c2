"""Many processes, one model: the distributed arc of the course.

The techniques, in the order the lessons teach them:

p2p             the one point-to-point primitive (send while receiving), and counting the bytes sent
collectives     broadcast, reduce, gather, scatter, all-gather, reduce-scatter, ring all-reduce,
                built from nothing but p2p's send and recv, and the ring's cost model
data_parallel   naive data parallelism and DDP from scratch (buckets, overlap, no_sync)
tensor_parallel Megatron-LM's column/row split: MLP, attention, vocab-parallel embedding and loss
pipeline_parallel  the executor: one step of any schedule (virtual stages, split backward), messages in one order
pipeline_schedules naive, GPipe, 1F1B, interleaved 1F1B and ZB-H1 as action lists; their simulation and bubbles
pipeline_stages how a model is cut into stages and chunks
mesh            DP x TP x PP process groups from one world, and training with any layout
zero_shard      one unit's parameters as one flat buffer, padded to N equal shards; all-gather, reduce-scatter
zero            ZeRO stages 1, 2 and 3 (a class each): optimizer state, gradients and parameters sharded
zero_common     what the stages share: units, frozen and tied parameters, the clipped step; zero_checks its guards
offload         ZeRO-Offload: master weights, moments and the optimizer step on the host
sequence_parallel Megatron-SP: norms and dropout split along the sequence, g/g-bar (all-gather/reduce-scatter)
sequence_parallel_attention  Megatron-SP's attention half and a whole pre-LN block under SP
sequence_layout how context parallelism cuts a sequence across ranks: contiguous or zig-zag chunks
context_parallel ring attention: Q stays, K/V blocks go round the ring, FlashAttention's online softmax
experts         expert parallelism: E/N experts per rank, tokens dispatched and combined by two all-to-alls
example         ``python -m llmedu.parallel.example``: one GPT trained with DDP, ZeRO or 3D, the same
                script under our launcher and under torchrun

The plumbing they stand on (no technique to learn here):

launch          N real processes from a notebook cell (or torchrun), each rank's result back
launch_rank     what each started rank runs: join the group, call the worker, send its result home
fork_server     one per rank index: imports PyTorch once and forks the ranks, in a fraction of a second
forked_ranks    the launcher's side of its fork servers: ask for a rank, watch it, stop it
processes       starting, watching and stopping the rank processes; a stalled or crashed rank is reported
replicas        the check that every rank holds the same replicated weights
events          spans of compute and communication on each rank, for the timelines
compat          the whole-tensor collectives under the names this PyTorch version has

Which of these techniques to use, and how many ranks each, is the planner's question: ``llmedu.planner``
(it imports this package; nothing here imports it).
"""

from .collectives import (
    all_gather,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    ring_all_reduce,
    scatter,
    traffic,
)
from .context_parallel import ring_attention
from .experts import ExpertParallelMoE
from .launch import WorkerError, launch
from .mesh import make_mesh, train_3d
from .offload import ZeROOffload
from .pipeline_parallel import (
    Pipeline,
    PipelineStage,
    bubble_fraction,
    partition,
    schedule,
    stage_chunks,
    theoretical_bubble,
)
from .pipeline_schedules import simulate
from .sequence_parallel import SequenceParallelMLPBlock, gather_sequence, reduce_scatter_sequence
from .sequence_parallel_attention import SequenceParallelBlock
from .tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    VocabParallelEmbedding,
    tensor_parallel,
    vocab_parallel_cross_entropy,
    vocab_parallel_lm_loss,
)
from .zero import ZeRO

__all__ = [
    "ring_attention",
    "ExpertParallelMoE",
    "SequenceParallelMLPBlock",
    "SequenceParallelBlock",
    "gather_sequence",
    "reduce_scatter_sequence",
    "launch",
    "WorkerError",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_gather",
    "all_to_all",
    "reduce_scatter",
    "ring_all_reduce",
    "traffic",
    "tensor_parallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelAttention",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_lm_loss",
    "Pipeline",
    "PipelineStage",
    "schedule",
    "partition",
    "bubble_fraction",
    "theoretical_bubble",
    "stage_chunks",
    "simulate",
    "make_mesh",
    "train_3d",
    "ZeRO",
    "ZeROOffload",
]
