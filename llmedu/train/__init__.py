"""Efficiency on one device: the trainer, mixed precision, activation recomputation.

loop          train(model, optimizer, batches, loss_fn, TrainConfig(...)): a budget in steps or
              seconds, gradient accumulation, precision, clipping, schedules, callbacks, checkpoints
precision     number formats, fp32 master weights, the dynamic loss scaler, autocast policies
recompute     activation checkpointing as an autograd.Function; per-block, sqrt(L), attention-only
schedules     warm-up, cosine, linear, triangular, one-cycle: step -> learning-rate multiplier
checkpoint    safetensors + JSON, written atomically, loaded without unpickling
"""

from .checkpoint import CheckpointError
from .loop import History, StepInfo, TrainConfig, log_to, train
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
]
