"""Parameter-efficient fine-tuning, one method per file, for our models and for ``transformers``'.

inject          find modules by name, wrap them, freeze the rest, count, save/load only adapters
lora            W0 x + (alpha / r) B A x on chosen linear layers; merge/unmerge/merge_and_unload (Hu et al. 2021)
adapters        bottleneck modules after attention and FFN projections (Houlsby et al. 2019)
prompt          prompt tuning (Lester et al. 2021) and prefix tuning (Li & Liang 2021)
llama_adapter   gated adaption prompts in the top layers (Zhang et al. 2023)
serving         several LoRA adapters on one frozen base, in one batch
"""

from .adapters import BottleneckAdapter, apply_adapters
from .inject import (
    adapter_state_dict,
    adapters_disabled,
    count_parameters,
    find_modules,
    freeze_base,
    load_adapter,
    mark_trainable,
    save_adapter,
    set_adapters_enabled,
)
from .llama_adapter import AdaptionPromptAttention, apply_llama_adapter
from .lora import LoRALinear, apply_lora, merge_and_unload, merge_lora, unmerge_lora
from .prompt import PrefixTuning, PromptTuning
from .serving import MultiLoRAModel

__all__ = [
    "apply_lora",
    "merge_lora",
    "unmerge_lora",
    "merge_and_unload",
    "LoRALinear",
    "apply_adapters",
    "BottleneckAdapter",
    "PromptTuning",
    "PrefixTuning",
    "apply_llama_adapter",
    "AdaptionPromptAttention",
    "find_modules",
    "freeze_base",
    "mark_trainable",
    "count_parameters",
    "adapter_state_dict",
    "save_adapter",
    "load_adapter",
    "set_adapters_enabled",
    "adapters_disabled",
    "MultiLoRAModel",
]
