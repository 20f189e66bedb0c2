"""Graders for lesson 19, parameter-efficient fine-tuning.

check_lora_forward(fn)        fn(x, weight, bias, A, B, alpha) -> W0 x + b + (alpha / r) B A x, the LoRA layer
                              (Hu et al. 2021, eq. 3); r is read from A's shape
check_lora_merge(fn)          fn(weight, A, B, alpha) -> the merged weight W0 + (alpha / r) B A, which must
                              compute what the unmerged layer computes
check_prefix_parameters(fn)   fn(n_virtual, n_layers, n_kv_heads, head_dim) -> trainable parameters of
                              prefix tuning without the MLP: a key and a value per virtual token and layer
check_lora_parameters(fn)     fn(r, n_layers, d_model, n_labels) -> trainable parameters of lesson 19's LoRA
                              row: LoRA on query and value of every layer of a BERT, plus the new classifier
                              head, counted on a real model of each size
check_lora_switch(fn)         fn(w_merged, A1, B1, A2, B2, alpha) -> the weight that serves adapter 2 from a
                              weight into which adapter 1 was merged; the two ranks differ, so do the scalings
check_prefix_break_even(fn)   fn(r, d_model, n_kv_heads, head_dim) -> how many virtual tokens of prefix tuning
                              train as many parameters as LoRA of rank r on q and v (2r without GQA, more with)
"""

from __future__ import annotations

import torch
from torch import nn

from llmedu.checks.core import CheckResult, Grader
from llmedu.peft.inject import count_parameters, mark_trainable
from llmedu.peft.lora import LoRALinear, apply_lora
from llmedu.peft.prompt import PrefixTuning

__all__ = [
    "check_lora_forward",
    "check_lora_merge",
    "check_prefix_parameters",
    "check_lora_parameters",
    "check_lora_switch",
    "check_prefix_break_even",
]

_SHAPES = [(8, 6, 2), (16, 32, 4), (32, 16, 1)]  # (d_in, d_out, r)


def _lora_layer(d_in: int, d_out: int, r: int, alpha: float, seed: int) -> LoRALinear:
    torch.manual_seed(seed)
    layer = LoRALinear(nn.Linear(d_in, d_out), r=r, alpha=alpha)
    with torch.no_grad():
        layer.lora_B.normal_()  # zero at init: a learner who forgot B A would still pass
    return layer


def check_lora_forward(fn) -> CheckResult:
    """Compare ``fn`` with ``llmedu.peft.LoRALinear`` on random layers and inputs."""
    g = Grader("check_lora_forward")
    for seed, (d_in, d_out, r) in enumerate(_SHAPES):
        for alpha in (1.0, 16.0):
            layer = _lora_layer(d_in, d_out, r, alpha, seed)
            x = torch.randn(3, 5, d_in)  # (B, T, d_in)
            with torch.no_grad():
                expected = layer(x)
                got = g.call(
                    fn,
                    x,
                    layer.base.weight.clone(),
                    layer.base.bias.clone(),
                    layer.lora_A.clone(),
                    layer.lora_B.clone(),
                    alpha,
                )
            g.compare(f"d_in={d_in}, d_out={d_out}, r={r}, alpha={alpha}", got, expected, atol=1e-5, rtol=1e-5)
    return g.result()


def check_lora_merge(fn) -> CheckResult:
    """The merged weight must equal W0 + (alpha / r) B A and give the unmerged layer's outputs."""
    g = Grader("check_lora_merge")
    for seed, (d_in, d_out, r) in enumerate(_SHAPES):
        alpha = 8.0
        layer = _lora_layer(d_in, d_out, r, alpha, seed)
        weight = layer.base.weight.detach().clone()
        got = g.call(fn, weight.clone(), layer.lora_A.detach().clone(), layer.lora_B.detach().clone(), alpha)
        g.compare(
            f"merged weight, d_in={d_in}, d_out={d_out}, r={r}", got, weight + layer.delta_weight().detach(), atol=1e-5
        )
        _same_output(g, "x W_merged^T + b equals the LoRA layer's output", got, layer, d_in)
    return g.result()


def _same_output(g: Grader, what: str, weight, layer, d_in: int) -> None:
    """A learner's weight, used as a plain linear layer, gives the LoRA layer's output on random inputs."""
    if isinstance(weight, torch.Tensor) and weight.shape == layer.base.weight.shape:
        x = torch.randn(4, d_in)
        with torch.no_grad():
            out = nn.functional.linear(x, weight, layer.base.bias)
            g.compare(what, out, layer(x), atol=1e-5, rtol=1e-5)


def check_prefix_parameters(fn) -> CheckResult:
    """Count against a real ``PrefixTuning`` on a tiny model of each shape."""
    from llmedu.models import CausalLM, TransformerConfig

    g = Grader("check_prefix_parameters")
    for n_virtual, n_layers, n_heads, n_kv_heads in [(4, 2, 4, 4), (10, 3, 4, 2), (1, 1, 2, 1)]:
        config = TransformerConfig.llama(
            vocab_size=32, d_model=16, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=n_layers, d_ff=32
        )
        expected = count_parameters(PrefixTuning(CausalLM(config), n_virtual=n_virtual))[0]
        got = g.call(fn, n_virtual, n_layers, n_kv_heads, config.head_dim)
        g.compare(
            f"{n_virtual} virtual tokens, {n_layers} layers, {n_kv_heads} KV heads of {config.head_dim}", got, expected
        )
    return g.result()


def check_prefix_break_even(fn) -> CheckResult:
    """How many virtual tokens make prefix tuning train as many parameters as LoRA of rank r on q and v?

    Counted on real models (ours, Llama-shaped: bias-free projections), multi-head and grouped-query:
    the answer is the LoRA count over the prefix count of one virtual token, a float.
    """
    from llmedu.models import CausalLM, TransformerConfig

    g = Grader("check_prefix_break_even")
    for r, d_model, n_heads, n_kv_heads in [(8, 64, 4, 4), (4, 64, 8, 2), (2, 96, 6, 1), (3, 64, 8, 2)]:  # 19.5
        config = TransformerConfig.llama(
            vocab_size=32, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=2, d_ff=32
        )
        lora = CausalLM(config)
        apply_lora(lora, ["q_proj", "v_proj"], r=r, alpha=2 * r)
        per_token = count_parameters(PrefixTuning(CausalLM(config), n_virtual=1))[0]
        got = g.call(fn, r, d_model, n_kv_heads, config.head_dim)
        expected = count_parameters(lora)[0] / per_token
        g.compare(f"r={r}, d_model={d_model}, {n_kv_heads} of {n_heads} heads keep K/V", got, expected, rtol=1e-9)
    return g.result()


def check_lora_parameters(fn) -> CheckResult:
    """Count against a real ``BertForSequenceClassification`` of each size, adapted as in the lesson."""
    from transformers import BertConfig, BertForSequenceClassification

    g = Grader("check_lora_parameters")
    for r, n_layers, d_model, n_labels in [(8, 6, 384, 2), (8, 2, 384, 2), (4, 3, 64, 5), (1, 1, 32, 3)]:
        config = BertConfig(
            vocab_size=50,  # the embeddings are frozen: their size cannot change the answer
            hidden_size=d_model,
            num_hidden_layers=n_layers,
            num_attention_heads=d_model // 32,
            intermediate_size=4 * d_model,
            num_labels=n_labels,
        )
        torch.manual_seed(0)
        model = BertForSequenceClassification(config)
        apply_lora(model, ["query", "value"], r=r, alpha=2 * r)
        mark_trainable(model, "classifier")
        got = g.call(fn, r, n_layers, d_model, n_labels)
        g.compare(f"r={r}, {n_layers} layers, d_model={d_model}, {n_labels} labels", got, count_parameters(model)[0])
    return g.result()


def check_lora_switch(fn) -> CheckResult:
    """The returned weight must be W0 + (alpha / r2) B2 A2 and compute what adapter 2's LoRA layer computes."""
    g = Grader("check_lora_switch")
    for seed, (d_in, d_out, r1, r2) in enumerate([(8, 6, 2, 4), (16, 32, 4, 1), (12, 12, 3, 3)]):
        alpha = 8.0
        first, second = _lora_layer(d_in, d_out, r1, alpha, seed), _lora_layer(d_in, d_out, r2, alpha, seed + 10)
        with torch.no_grad():
            second.base.weight.copy_(first.base.weight)  # one frozen W0, two adapters
            second.base.bias.copy_(first.base.bias)
            w0 = first.base.weight.clone()
            first.merge()
            w_merged = first.base.weight.clone()
        got = g.call(
            fn,
            w_merged.clone(),
            first.lora_A.detach().clone(),
            first.lora_B.detach().clone(),
            second.lora_A.detach().clone(),
            second.lora_B.detach().clone(),
            alpha,
        )
        # fp32 sums of a few terms of size <= ~10: 1e-5 absolute is tens of ulps, far below any real mistake
        g.compare(
            f"weight for adapter 2, d_in={d_in}, d_out={d_out}, r1={r1}, r2={r2}",
            got,
            w0 + second.delta_weight().detach(),
            atol=1e-5,
            rtol=1e-5,
        )
        _same_output(g, "x W^T + b equals adapter 2's LoRA layer", got, second, d_in)
    return g.result()
