"""llmedu: how large language models are trained efficiently, from scratch in readable PyTorch.

The library is the curriculum: each folder is one arc of the course, each file one concept.

    runtime      device choice (cuda > mps > cpu), seeding, fast mode (LLMEDU_FAST), timers
    hardware     measured FLOP/s and bandwidth of this machine; accelerator spec sheets; roofline; 6ND costs
    tokenizers   byte-level BPE (encodes exactly like GPT-2), WordPiece (like BERT), Unigram (SentencePiece)
    nn           the parts: positions, norms, activations and FFNs, attention (MHA/GQA/MQA, KV cache), blocks
    models       TransformerConfig (every variant a field; GPT-2, BERT, Llama presets), GPT, BERT, from_hf/to_hf
    data         corpora, labelled tasks and reference files, read offline after ``python -m llmedu.data fetch``;
                 packing and masking for masked-LM pretraining
    memory       where the bytes of a training step go: measured, estimated, simulated
    optim        AdamW from scratch, and 8-bit AdamW (block-wise quantized moments)
    train        the trainer (budget, accumulation, precision, clipping, schedules, checkpoints), loss
                 scaling and master weights, simulated fp8, activation recomputation
    parallel     many processes: launch, collectives from send/recv, data/tensor/pipeline parallelism
                 (interleaved, zero-bubble), sequence and context parallelism, expert parallelism, the
                 DP x TP x PP mesh, ZeRO-1/2/3, ZeRO-Offload, per-rank event logs
    planner      which layout when: a cost model of a cluster, the memory and time of a layout, the search,
                 checked against published runs and calibrated by probes of this machine
    kernels      FlashAttention-2 written out tile by tile (forward and backward)
    inference    serving: a paged KV cache (block tables, copy-on-write), continuous batching, cache waste
    peft         prompt and prefix tuning, adapters, LLaMA-Adapter, LoRA, on our models and transformers'
    compress     int8, LLM.int8, SmoothQuant, NF4, GPTQ, QLoRA; distillation; pruning
    retrieval    vector indexes from scratch (exact, IVF, PQ; checked against FAISS), kNN-LM, in-context
                 retrieval, knowledge updates without retraining
    cramming     the capstone: a BERT pretrained under a wall-clock budget, then fine-tuned (Cramming); its
                 studies (seeds, sweeps, grids behind data/results/) apart in cramming.studies
    viz          live plots for training loops (a static figure when headless); per-rank timelines
    checks       graders for the exercises: check_x(your_function) says pass or fail, and why

``llmedu.show(obj)`` prints the source of anything in here, so a notebook can show the code it runs
instead of pasting it.
"""

from __future__ import annotations

import inspect

__version__ = "0.1.0"
__all__ = ["show", "__version__"]


def show(obj) -> None:
    """Print the source code of a function, class, method or module.

    In Jupyter the code is rendered with syntax highlighting; elsewhere it is printed as text.
    """
    try:
        source = inspect.getsource(obj)
    except (TypeError, OSError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from None
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Code(source, language="python"))
    else:
        print(source)
