"""Efficiency on one device: the trainer, mixed precision, activation recomputation.

loop          train(model, optimizer, batches, loss_fn, TrainConfig(...)): a budget in steps or
              seconds, gradient accumulation, precision, clipping, schedules, callbacks, checkpoints
precision     number formats, fp32 master weights, the dynamic loss scaler, autocast policies
recompute     activation checkpointing as an autograd.Function; per-block, sqrt(L), attention-only
schedules     warm-up, cosine, linear, triangular, one-cycle: step -> learning-rate multiplier
checkpoint    safetensors + JSON, written atomically, loaded without unpickling, checked by sha256
clipping      global-norm gradient clipping (Pascanu et al. 2013), equal to torch.nn.utils.clip_grad_norm_
history       StepInfo per step, the History of a run, the callback that logs it live
fp8           E4M3 / E5M2 simulated bit for bit, delayed (amax-history) scaling, FP8Linear
fp8_run       one small GPT trained in fp32, bf16 and simulated fp8 side by side
accumulation  why accumulators stay fp32 (the bf16 stall point), and TF32's rounding, in numbers
"""

from .accumulation import matmul_errors, round_to_tf32, running_sum, stall_point
from .checkpoint import CheckpointError
from .clipping import clip_grad_norm, clip_grads_with_norm, global_grad_norm
from .fp8 import FORMATS, DelayedScaling, FP8Format, FP8Linear, cast_to_fp8, convert_to_fp8, fp8_counts, get_format
from .fp8_run import compare_precisions
from .history import History, StepInfo, log_to
from .loop import TrainConfig, train
from .precision import PRECISIONS, LossScaler, MasterWeights, Precision
from .recompute import POLICIES, apply_policy

__all__ = [
    "CheckpointError",
    "History",
    "StepInfo",
    "TrainConfig",
    "log_to",
    "train",
    "PRECISIONS",
    "LossScaler",
    "MasterWeights",
    "Precision",
    "POLICIES",
    "apply_policy",
    "FORMATS",
    "FP8Format",
    "get_format",
    "cast_to_fp8",
    "DelayedScaling",
    "FP8Linear",
    "convert_to_fp8",
    "fp8_counts",
    "compare_precisions",
    "running_sum",
    "stall_point",
    "round_to_tf32",
    "matmul_errors",
    "clip_grad_norm",
    "clip_grads_with_norm",
    "global_grad_norm",
]
