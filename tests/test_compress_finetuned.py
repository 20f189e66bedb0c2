"""Fast mode's base for lesson 22: lesson 19's shipped LoRA adapter merged into all-MiniLM-L6-v2.

Nothing is trained: the test checks the file against its record (a flipped byte is refused before it is
read), that the merged model is a plain classifier computing what the adapter computes, and its accuracy on
the first 256 validation snippets (80.5% when it was shipped; 80.6% on the whole split).
"""

import json
import shutil

import pytest
import torch

from llmedu.compress import finetuned
from llmedu.peft import shipped
from llmedu.peft.lora import LoRALinear

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base():
    return finetuned.shipped_base()


def test_the_recipe_is_the_one_the_adapter_records():
    record = json.loads((shipped.ADAPTER_DIR / f"{finetuned.SHIPPED.adapter}.json").read_text())
    r = record["recipe"]
    assert (record["steps"], r["batch_size"], r["max_len"], r["lr"], r["seed"]) == (
        finetuned.SHIPPED.steps,
        finetuned.SHIPPED.batch_size,
        finetuned.SHIPPED.max_len,
        finetuned.SHIPPED.lr,
        finetuned.SHIPPED.seed,
    )
    assert finetuned.SHIPPED.key() == record["sha256"][:12]


def test_the_shipped_base_is_the_adapter_merged_into_a_plain_classifier(base):
    assert not any(isinstance(m, LoRALinear) for m in base.modules())
    assert all(p.requires_grad for p in base.parameters())  # the compression methods fine-tune every weight
    torch.manual_seed(0)
    adapted = shipped.lora_model(finetuned.new_classifier())
    shipped.load_shipped(adapted, finetuned.SHIPPED.adapter)
    batch = finetuned.rotten_tomatoes("validation", 16, limit=16)[0]
    with torch.no_grad():
        merged = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (16, 2)
        unmerged = adapted.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


def test_the_shipped_base_learned_the_task(base):
    val = finetuned.rotten_tomatoes("validation", 64, limit=256)
    assert finetuned.accuracy(base, val) >= 0.78  # 0.805 when shipped; the majority class is 0.53


def test_an_altered_adapter_file_is_refused_before_it_is_read(tmp_path):
    name = finetuned.SHIPPED.adapter
    for suffix in (".json", ".safetensors"):
        shutil.copy(shipped.ADAPTER_DIR / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    path = tmp_path / f"{name}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{name}.safetensors has sha256 .*its record says"):
        finetuned.shipped_base(tmp_path)


def test_by_length_scores_the_same_snippets_in_fewer_padded_tokens():
    shuffled = finetuned.rotten_tomatoes("validation", 16, limit=96)
    ordered = finetuned.rotten_tomatoes("validation", 16, limit=96, by_length=True)
    assert sorted(zip(ordered.texts, ordered.labels)) == sorted(zip(shuffled.texts, shuffled.labels))
    assert [len(t) for t in ordered.texts] == sorted(len(t) for t in shuffled.texts)

    def padded(data):
        return sum(data[i]["input_ids"].numel() for i in range(len(data)))

    assert padded(ordered) < 0.8 * padded(shuffled)
