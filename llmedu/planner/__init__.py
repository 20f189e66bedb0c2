"""Which parallel layout when, computed: the cost model of a cluster, and the search over layouts.

Lesson 16. Given a model, a cluster and a global batch, ``plan`` enumerates every
DP x TP x PP x CP (x EP) layout with its ZeRO stage, recomputation, micro-batch and offload, keeps the
ones whose busiest rank fits in memory, and ranks the rest by predicted step time::

    from llmedu.planner import Batch, cluster, plan
    for p in plan("llama3-70b", cluster("dgx-a100", nodes=8), Batch(512, 2048), top=3):
        print(p.row())

Read it bottom up; each file imports only the ones above it in this list (tests/test_imports.py checks
that there is no import circle, and that nothing in ``parallel`` imports the planner):

sharing       ``Sharing``: what ranks that share one CPU cost each other (a speed and a wait per message)
clusters      links and clusters: what a collective costs on a link (alpha-beta, ring or tree), presets
              of GPU nodes (A100, H100; InfiniBand, NVLink, Ethernet) from their datasheets
memory        ``Layout`` and ``Batch``; what each rank of a layout holds, and its bytes, on paper
messages      the collectives a layout sends, counted from our wrappers: how many, what kind, what size
step_time     the seconds of one optimizer step of a layout: compute, collectives, bubble, what overlap hides
search        ``plan``, ``evaluate`` and ``layouts``: the search, and the model presets (GPT-3, Llama 3, ...)
published     published runs (Megatron-LM, BLOOM, Llama 3) through the cost model, beside the planner's pick
probes        this CPU as a ``Cluster``: matmul FLOP/s, AdamW, overheads and gloo's alpha-beta, measured
shared_cores  how ranks that share this CPU slow each other, measured (the two numbers of ``Sharing``)
measured      layouts trained for real on CPU processes, measured, with the planner's prediction beside them

The planner imports ``parallel`` (our wrappers, to measure them), ``models`` and ``hardware``; the
techniques themselves live in ``parallel`` and know nothing of it.
"""

from .clusters import CLUSTERS, ETHERNET, Cluster, Link, cluster
from .memory import Batch, Layout
from .probes import local_cluster
from .search import MODELS, NothingFits, Plan, evaluate, layouts, plan

__all__ = [
    "plan",
    "evaluate",
    "layouts",
    "Plan",
    "NothingFits",
    "MODELS",
    "Layout",
    "Batch",
    "Cluster",
    "Link",
    "cluster",
    "CLUSTERS",
    "ETHERNET",
    "local_cluster",
]
