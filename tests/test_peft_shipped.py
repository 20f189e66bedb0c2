"""The shipped LoRA adapters (data/adapters/): files match their records, load into the base they were
trained on and nowhere else, refuse a changed file before reading it, and do what they were trained for."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from torch import nn

from llmedu.peft import shipped
from llmedu.peft.inject import base_fingerprint, load_adapter


def record(name):
    return json.loads((shipped.ADAPTER_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize("name", shipped.NAMES)
def test_file_matches_its_record(name):
    rec, path = record(name), shipped.ADAPTER_DIR / f"{name}.safetensors"
    assert path.stat().st_size == rec["bytes"] < 2**20  # a few hundred KiB, small enough for git
    assert shipped._sha256(path) == rec["sha256"]
    assert rec["recipe"] == shipped.recipe(name)  # the recipe in the code is the one the file was trained with
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["llmedu.base"] == rec["base_fingerprint"]
        names = set(f.keys())
        assert sum(f.get_tensor(n).numel() for n in names) == rec["trainable_parameters"]
    layers, targets = shipped.RECIPE["layers"], shipped.RECIPE["targets"]
    assert names == {
        f"bert.encoder.layer.{i}.attention.self.{t}.lora_{m}" for i in range(layers) for t in targets for m in "AB"
    } | {"classifier.weight", "classifier.bias"}


@pytest.fixture(scope="module")
def base():
    return shipped.base_model()


@pytest.fixture(scope="module")
def loaded(base):
    models = {}
    for name in shipped.NAMES:
        models[name] = shipped.lora_model(base)
        shipped.load_shipped(models[name], name)
    return models


def test_base_fingerprint_is_the_recorded_one(base):
    assert base_fingerprint(shipped.lora_model(base)) == record(shipped.NAMES[0])["base_fingerprint"]


def test_the_adapters_work(loaded):
    # The record holds ~80% on all 1,285 validation snippets; on 128 of them one standard error is
    # ~3.5 points, so 70% is ~3 below it and still far above the majority class (~53%).
    _, _, texts, labels = shipped.load_splits()
    texts, labels = texts[:128], labels[:128]
    tok = shipped.tokenizer()
    assert shipped.accuracy(loaded[shipped.NAMES[0]], tok, texts, labels) > 0.70
    inverted = [1 - y for y in labels]  # the second adapter learned the opposite labels
    assert shipped.accuracy(loaded[shipped.NAMES[1]], tok, texts, inverted) > 0.70


def test_refuses_another_base(base, loaded):
    two_layers = shipped.lora_model(shipped.base_model(layers=2))
    with pytest.raises(ValueError, match="does not fit"):
        shipped.load_shipped(two_layers, shipped.NAMES[0])
    other = shipped.lora_model(base)
    with torch.no_grad():
        other.bert.embeddings.word_embeddings.weight[0, 0] += 1.0  # a frozen weight of another checkpoint
    with pytest.raises(ValueError, match="another base model"):
        shipped.load_shipped(other, shipped.NAMES[0])


def copy_files(tmp_path, name=shipped.NAMES[0]):
    for suffix in (".json", ".safetensors"):
        shutil.copy(shipped.ADAPTER_DIR / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    return tmp_path / f"{name}.safetensors"


def test_refuses_a_changed_file_before_reading_it(tmp_path):
    path = copy_files(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one tensor byte changed: same size, another sha256
    path.write_bytes(bytes(data))
    never_loaded = nn.Linear(1, 1)  # the check comes first: the model is never looked at
    with pytest.raises(ValueError, match="sha256"):
        shipped.load_shipped(never_loaded, folder=tmp_path)
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(ValueError, match="bytes"):
        shipped.load_shipped(never_loaded, folder=tmp_path)


def test_bad_names_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="unknown shipped adapter"):
        shipped.recipe("rotten_tomatoes_lora_v2")
    with pytest.raises(ValueError, match="unknown shipped adapter"):
        shipped.load_shipped(nn.Linear(1, 1), "rotten_tomatoes_lora_v2")
    with pytest.raises(FileNotFoundError, match="data/adapters"):
        shipped.load_shipped(nn.Linear(1, 1), folder=tmp_path)
    copy_files(tmp_path).unlink()  # the record without its file
    with pytest.raises(FileNotFoundError, match="rotten_tomatoes_lora.safetensors"):
        shipped.load_shipped(nn.Linear(1, 1), folder=tmp_path)
    with pytest.raises(ValueError, match="as many labels"):
        shipped.accuracy(nn.Linear(1, 1), None, ["a", "b"], [1])


def test_a_damaged_record_or_adapter_file_is_named(tmp_path):
    """A record that is not UTF-8, cut short or without its checksum, and an adapter file cut short, are errors
    that name the file and say what is wrong (not a bare UnicodeDecodeError, JSONDecodeError or KeyError)."""
    path = copy_files(tmp_path)
    record_path = tmp_path / f"{shipped.NAMES[0]}.json"
    text = record_path.read_bytes()
    record_path.write_bytes(text[:10] + b"\xe9" + text[10:])  # a Latin-1 byte in a UTF-8 file
    with pytest.raises(ValueError, match=rf"{record_path.name} is not an adapter record: byte 10 is not UTF-8"):
        shipped.load_shipped(nn.Linear(1, 1), folder=tmp_path)
    record_path.write_bytes(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{record_path.name} is not an adapter record: invalid JSON, cut short"):
        shipped.load_shipped(nn.Linear(1, 1), folder=tmp_path)
    record_path.write_text(json.dumps({k: v for k, v in json.loads(text).items() if k != "sha256"}))
    with pytest.raises(ValueError, match=rf"{record_path.name} is not an adapter record: it has no sha256"):
        shipped.load_shipped(nn.Linear(1, 1), folder=tmp_path)
    path.write_bytes(path.read_bytes()[:-100])  # the adapter file itself, cut short, read directly
    with pytest.raises(ValueError, match=rf"{path.name} is not a readable adapter file \(safetensors\)"):
        load_adapter(nn.Linear(1, 1), path)
