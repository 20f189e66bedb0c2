"""QLoRA: LoRA on a frozen NF4 base. The 4-bit layer computes with its dequantized weight, keeps no
16/32-bit copy for backward, trains only the adapters, and a tiny run lowers the loss."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from llmedu.compress.nf4 import dequantize_nf4, quantize_nf4
from llmedu.compress.qlora import NF4Linear, QLoRALinear, apply_qlora, paired_step_times, weight_bytes
from llmedu.peft import count_parameters, mark_trainable

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops on a busy 2-core CPU


def test_nf4_linear_is_the_linear_with_the_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    x = torch.randn(2, 5, 128)
    layer = NF4Linear(linear, compute_dtype=torch.float32)
    w = dequantize_nf4(quantize_nf4(linear.weight))
    # the same float32 matmul on the same numbers; 1e-6: summation order of x @ W^T vs F.linear
    assert torch.allclose(layer(x), F.linear(x, w, linear.bias), atol=1e-6)
    assert (layer(x) - linear(x)).abs().max() > 1e-3  # and it is 4-bit: not the original layer
    bf16 = NF4Linear(linear)(x)  # the default compute dtype: bf16 operands, output cast back to x's dtype
    assert bf16.dtype == torch.float32 and (bf16 - F.linear(x, w, linear.bias)).abs().max() < 0.05


def test_backward_keeps_no_dequantized_weight():
    torch.manual_seed(0)
    layer = NF4Linear(nn.Linear(128, 64), compute_dtype=torch.float32)
    x = torch.randn(8, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = layer(x)
    assert (64, 128) not in saved and (128, 64) not in saved  # only the 4-bit codes stay (as buffers)
    y.square().sum().backward()
    w = layer.dequantized_weight()
    assert torch.allclose(x.grad, (2 * y.detach()) @ w, atol=1e-5)  # dX = dY W, W dequantized again
    assert not any(p.requires_grad for p in layer.parameters())


def test_the_double_quant_mean_is_a_buffer_saved_and_moved_with_the_layer():
    torch.manual_seed(0)
    layer = NF4Linear(nn.Linear(128, 64), compute_dtype=torch.float32)
    state = layer.state_dict()
    assert state["absmax_offset"].shape == () and state["absmax_offset"].item() != 0  # the mean of the absmaxes
    # a layer quantized from other weights, given this state, computes exactly what this one does
    other = NF4Linear(nn.Linear(128, 64), compute_dtype=torch.float32)
    x = torch.randn(3, 128)
    assert not torch.equal(other(x), layer(x))
    other.load_state_dict(state)
    assert torch.equal(other(x), layer(x))
    assert layer.to("meta").absmax_offset.device.type == "meta"  # .to() moves it with the codes
    no_dq = NF4Linear(nn.Linear(128, 64), double_quant=False, compute_dtype=torch.float32)
    assert no_dq.absmax_offset is None and "absmax_offset" not in no_dq.state_dict()


def test_qlora_starts_as_the_quantized_base_and_trains_only_the_adapters():
    torch.manual_seed(0)
    base = NF4Linear(nn.Linear(64, 32), compute_dtype=torch.float32)
    layer = QLoRALinear(base, r=4, alpha=8)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), base(x))  # B = 0 at init
    layer(x).sum().backward()
    assert layer.lora_B.grad is not None and layer.lora_B.grad.abs().sum() > 0
    assert [n for n, _ in layer.named_parameters()] == ["lora_A", "lora_B"]


def test_apply_qlora_quantizes_every_linear_but_the_skipped(tiny_bert):
    model = copy.deepcopy(tiny_bert)
    adapted = apply_qlora(model, ["query", "value"], r=4, skip=["classifier", "pooler"], compute_dtype=torch.float32)
    assert adapted == [f"bert.encoder.layer.{i}.attention.self.{n}" for i in range(2) for n in ("query", "value")]
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, NF4Linear))}
    assert kinds["classifier"] == "Linear" and kinds["bert.pooler.dense"] == "Linear"
    assert sum(k == "NF4Linear" for k in kinds.values()) == 2 * 6  # q, k, v, o, up, down per layer
    mark_trainable(model, "classifier")
    trainable, _ = count_parameters(model)
    assert trainable == 4 * 4 * (32 + 32) + (32 * 2 + 2)  # 4 adapters of r (d_in + d_out), and the head
    # the encoder's linear weights: 4.127 bits each plus fp32-to-compute-dtype biases, vs 32 bits
    before = sum(weight_bytes(m) for n, m in tiny_bert.named_modules() if isinstance(m, nn.Linear) and "encoder" in n)
    after = sum(weight_bytes(m) for n, m in model.named_modules() if isinstance(m, NF4Linear))
    assert after < before / 4


def test_a_tiny_qlora_run_lowers_the_loss(tiny_bert):
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_bert)
    apply_qlora(model, ["query", "key", "value"], r=4, alpha=8, skip=["classifier", "pooler"])  # bf16 compute
    mark_trainable(model, "classifier")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 64, (32, 8), generator=g)
    labels = torch.randint(0, 2, (32,), generator=g)
    ids[labels == 1, 3] = 4  # the label is whether token 4 sits at position 3
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    model.train()
    for _ in range(30):
        loss = F.cross_entropy(model(input_ids=ids).logits.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # from ln 2 = 0.69 (a fresh head) to well below: measured ~0.2 after 30 steps
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


@pytest.mark.slow  # loads MiniLM, trains 2 steps per method: ~30 s on a busy 2-core machine
def test_compare_on_rotten_tomatoes_runs_and_counts_memory():
    from llmedu.compress.qlora import compare_on_rotten_tomatoes

    res = compare_on_rotten_tomatoes(steps=2, batch_size=4, max_len=16, layers=1, n_val=16, timing_repeats=2)
    assert set(res) == {"LoRA bf16", "QLoRA NF4", "majority class", "paired step"}
    paired = res["paired step"]
    assert len(paired["ratios"]) == 2 and paired["ratio_lo"] <= paired["ratio"] <= paired["ratio_hi"]
    lora, qlora = res["LoRA bf16"], res["QLoRA NF4"]
    assert lora["trainable"] == qlora["trainable"]
    # bf16 weights: 16 bits; NF4 with double quantization: 4.127 bits, plus bf16 biases: ~3.5x smaller
    assert 3 < lora["encoder_linear_mib"] / qlora["encoder_linear_mib"] < 4
    assert 0 <= qlora["accuracy"] <= 1


def test_bad_input_gets_a_clear_error(tiny_bert):
    with pytest.raises(TypeError, match="quantizes an nn.Linear"):
        NF4Linear(nn.Identity())
    with pytest.raises(ValueError, match="block_size=64 does not divide"):
        NF4Linear(nn.Linear(10, 10))
    with pytest.raises(TypeError, match="wraps an NF4Linear"):
        QLoRALinear(nn.Linear(64, 64), r=4)
    base = NF4Linear(nn.Linear(64, 32))
    with pytest.raises(ValueError, match="rank r must be a positive int"):
        QLoRALinear(base, r=0)
    with pytest.raises(ValueError, match="exceeds min"):
        QLoRALinear(base, r=33)
    with pytest.raises(ValueError, match="expected inputs with 64 features"):
        base(torch.randn(2, 63))
    with pytest.raises(ValueError, match="both LoRA targets and skipped"):
        apply_qlora(copy.deepcopy(tiny_bert), ["query"], skip=["query"])
    with pytest.raises(ValueError, match="matches no module"):
        apply_qlora(copy.deepcopy(tiny_bert), ["qkv_proj"])
    from llmedu.compress.qlora import compare_on_rotten_tomatoes

    with pytest.raises(ValueError, match="unknown methods"):
        compare_on_rotten_tomatoes(methods=["LoRA fp16"])
    model = copy.deepcopy(tiny_bert)
    apply_qlora(model, ["query"], r=2, skip=["classifier", "pooler"])
    with pytest.raises(ValueError, match="already applied"):
        apply_qlora(model, ["query"])


def test_paired_step_times_cancel_the_hosts_drift_and_alternate_the_order():
    """Two runs that cost 1 and 3 time units a step, on a host that slows down by 50% after every pair: each
    pair's ratio is 3 although the times themselves grow 7-fold from the first pair to the last."""
    now, order = [0.0], []

    class Run(nn.Module):
        def __init__(self, name, cost):
            super().__init__()
            self.name, self.cost, self.w = name, cost, nn.Parameter(torch.ones(1))

    def loss_fn(model, batch):
        order.append(model.name)
        now[0] += model.cost * 1.5 ** ((len(order) - 3) // 2 if len(order) > 2 else 0)  # drift between pairs
        return model.w.sum()

    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.0)) for m in (Run("a", 1.0), Run("b", 3.0))]
    res = paired_step_times(runs, {}, loss_fn, repeats=6, clock=lambda: now[0])
    assert res["ratios"] == pytest.approx([3.0] * 6) and res["ratio_lo"] == pytest.approx(3.0)
    assert order == ["a", "b"] + ["a", "b", "b", "a"] * 3  # warm-up, then the order flips each pair
    assert res["median_s"][1] / res["median_s"][0] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="compares two"):
        paired_step_times(runs[:1], {}, loss_fn)
    with pytest.raises(ValueError, match="repeats must be a positive int"):
        paired_step_times(runs, {}, loss_fn, repeats=0)
