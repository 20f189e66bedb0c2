"""Model compression, one method per file: quantization (and, beside it, distillation and pruning).

int8          symmetric/asymmetric integer quantization, per-tensor or per-channel; ``QuantLinear``:
              int8 weights, dynamic int8 activations, an int8 x int8 -> int32 matmul (``torch._int_mm``);
              equal to ``torch.ao.quantization.quantize_dynamic`` in codes and outputs (Jacob et al. 2018);
              ``Int8Embedding``: an embedding table as int8 rows with one scale each
llm_int8      vector-wise int8 matmul with the outlier columns in floating point; outlier features of a
              real model, measured (Dettmers et al. 2022)
smoothquant   migrate activation outliers into the weights, folded into a pre-LN LayerNorm or, post-LN,
              kept in a ``SmoothedLinear`` (Xiao et al. 2023)
nf4           the 4-bit NormalFloat code, block-wise absmax, double quantization (Dettmers et al. 2023)
gptq          column-by-column rounding with error feedback through the inverse Hessian (Frantar et al. 2022);
              ``PackedLinear``: its codes (or round-to-nearest's) stored packed, two 4-bit codes a byte
qlora         LoRA on a frozen NF4 base; the Rotten Tomatoes comparison with bf16 LoRA (Dettmers et al. 2023)
distillation  soft targets (T^2 KL), hidden-state and attention transfer, DistilBERT-style students
              (Hinton et al. 2015; Sanh et al. 2019; Wang et al. 2020)
pruning       magnitude, N:M (2:4) masks, head importance and removal (Han et al. 2015; Mishra et al. 2021;
              Michel et al. 2019)
finetuned, baselines, compare, rows_quant
              lesson 22's base model (cached by recipe hash), its majority-class and TF-IDF baselines,
              the one-table measurement of bytes, latency and accuracy, and the whole-model LLM.int8,
              SmoothQuant and GPTQ/RTN builders of its quantized rows
"""

from .distillation import DistillationLoss, make_student, soft_target_loss
from .gptq import PackedLinear, gptq_codes, gptq_quantize, hessian, layer_error, rtn_codes, rtn_quantize
from .int8 import Int8Embedding, QuantLinear, dequantize, int8_matmul, qrange, quantize, quantize_linears
from .llm_int8 import LLMInt8Linear, llm_int8_matmul, outlier_columns, outlier_features, vectorwise_int8_matmul
from .nf4 import NF4Tensor, dequantize_nf4, nf4_bits_per_parameter, nf4_code, quantize_nf4
from .pruning import head_importance, magnitude_masks, nm_mask, remove_heads
from .qlora import NF4Linear, QLoRALinear, apply_qlora, compare_on_rotten_tomatoes, weight_bytes
from .smoothquant import SmoothedLinear, smooth_layernorm_linears, smooth_linear_weight, smoothing_scales, w8a8_linear

__all__ = [
    # int8
    "quantize",
    "dequantize",
    "qrange",
    "int8_matmul",
    "QuantLinear",
    "quantize_linears",
    "Int8Embedding",
    # llm_int8
    "outlier_columns",
    "vectorwise_int8_matmul",
    "llm_int8_matmul",
    "LLMInt8Linear",
    "outlier_features",
    # smoothquant
    "smoothing_scales",
    "smooth_linear_weight",
    "smooth_layernorm_linears",
    "SmoothedLinear",
    "w8a8_linear",
    # nf4
    "nf4_code",
    "NF4Tensor",
    "quantize_nf4",
    "dequantize_nf4",
    "nf4_bits_per_parameter",
    # gptq
    "hessian",
    "rtn_codes",
    "rtn_quantize",
    "gptq_codes",
    "gptq_quantize",
    "layer_error",
    "PackedLinear",
    # qlora
    "NF4Linear",
    "QLoRALinear",
    "apply_qlora",
    "weight_bytes",
    "compare_on_rotten_tomatoes",
    # distillation
    "soft_target_loss",
    "DistillationLoss",
    "make_student",
    # pruning
    "magnitude_masks",
    "nm_mask",
    "head_importance",
    "remove_heads",
]
