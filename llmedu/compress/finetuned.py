"""The one model that lesson 22 compresses: all-MiniLM-L6-v2 fine-tuned on Rotten Tomatoes, made once.

Every row of the compression table (quantized, distilled, pruned) starts from the same weights, so
they are made by one short, seeded recipe (``Recipe``) and kept in the data cache as safetensors,
under a name that holds the sha256 of the recipe: ``cache_dir()/compress/minilm-rt-<hash>.safetensors``.
A changed recipe is a new file; an altered or truncated file fails its recorded checksum
(``llmedu.data.cache.read_derived``) and is made again.

Also here, because every method needs them: the tokenizer, the two splits encoded as padded batches
(``Batches``), and ``accuracy``. The model is ``transformers``' ``BertForSequenceClassification`` (a
new 2-way head on the pooled ``[CLS]`` state), the same one lesson 19 fine-tunes.

How fast it learns (measured here, lr 5e-5, batch 32, on 320 validation snippets): 56% after 20 steps,
72% after 40, 76% after 60 (the majority class: 53% of the whole split). The head reads the pooled
``[CLS]`` state, which all-MiniLM-L6-v2 was not trained to make meaningful (its sentence embedding is
the mean over tokens: ``1_Pooling/config.json``), so a short run first learns the label prior.

Fast mode trains nothing: the full model (22.7M parameters, 91 MB in fp32) is too large to commit, so
when ``Recipe()``'s model is not cached, ``lesson_base`` returns ``SHIPPED``: all-MiniLM-L6-v2 with
lesson 19's shipped LoRA adapter (r=8 on query and value, and the 2-way head: 301 kB in
``data/adapters/``, 80.6% on the 1,285 validation snippets) merged into its weights, a plain
``BertForSequenceClassification`` again. ``llmedu.peft.shipped.load_shipped`` checks the file's size and
sha256 against its record before reading it as safetensors; ``python -m llmedu.peft.shipped
rotten_tomatoes_lora`` rebuilds it. It is a fine-tuned model of the same architecture, but fine-tuned
by another method (a rank-8 update of 12 matrices, not every weight), so only full mode's numbers are
the lesson's results; ``lesson_base`` says which base it returns.

Left out: a learning-rate search (the rate is lesson 19's full fine-tuning rate) and evaluation during
training. Re-running a recipe on other hardware gives weights equal to a float tolerance, not bitwise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..data import load_classification, reference_files
from ..data.cache import cache_dir, read_derived, write_derived

__all__ = [
    "Recipe",
    "ShippedRecipe",
    "SHIPPED",
    "shipped_base",
    "Batches",
    "tokenizer",
    "rotten_tomatoes",
    "new_classifier",
    "finetuned_classifier",
    "is_cached",
    "lesson_base",
    "accuracy",
    "state_bytes",
]


@dataclass(frozen=True)
class Recipe:
    steps: int = 360  # optimizer steps (360 x 32 = one pass over the 11.5k training snippets)
    batch_size: int = 32
    max_len: int = 64  # tokens; a batch is padded to its longest snippet, at most this
    lr: float = 5e-5  # AdamW, constant (lesson 19's full fine-tuning rate)
    seed: int = 0
    method: ClassVar[str] = "full fine-tuning"  # not a field: not part of the key

    def key(self) -> str:
        """The first 12 hex digits of the sha256 of the recipe: the cache file's name."""
        text = json.dumps({"model": "all-minilm-l6-v2", **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ShippedRecipe:
    """How fast mode's base was made: lesson 19's LoRA recipe (``llmedu.peft.shipped.RECIPE``), merged."""

    adapter: str = "rotten_tomatoes_lora"  # in data/adapters/
    steps: int = 720  # two passes of 32 snippets over the training split
    batch_size: int = 32
    max_len: int = 64
    lr: float = 1e-3
    seed: int = 0
    method: ClassVar[str] = "LoRA r=8 on query and value, merged, and the head"

    def key(self) -> str:
        """The first 12 hex digits of the adapter file's recorded sha256."""
        from ..peft.shipped import ADAPTER_DIR

        return json.loads((ADAPTER_DIR / f"{self.adapter}.json").read_text())["sha256"][:12]


SHIPPED = ShippedRecipe()


def tokenizer():
    """bert-base-uncased's WordPiece tokenizer, as all-MiniLM-L6-v2 ships it (read offline)."""
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(reference_files("all-minilm-l6-v2")["config.json"].parent)
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102], "the tokenizer did not load its vocabulary"
    return tok


class Batches:
    """One split of Rotten Tomatoes, shuffled once by ``seed``; ``batches[i]`` is the i-th padded batch
    (wrapping round), a dict of ``input_ids``/``attention_mask`` (B, T) and ``labels`` (B,)."""

    def __init__(self, texts: list[str], labels: list[int], batch_size: int, max_len: int, seed: int = 0):
        if batch_size < 1 or max_len < 2:
            raise ValueError(f"batch_size must be >= 1 and max_len >= 2, got {batch_size} and {max_len}")
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
        self.texts = [texts[i] for i in order]  # the file is sorted by movie: shuffle
        self.labels = [labels[i] for i in order]
        self.batch_size, self.max_len = batch_size, max_len
        self._tok = tokenizer()

    def __len__(self) -> int:  # batches in one pass
        return -(-len(self.texts) // self.batch_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = (i % len(self)) * self.batch_size
        texts, labels = self.texts[start : start + self.batch_size], self.labels[start : start + self.batch_size]
        enc = self._tok(texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": torch.tensor(labels)}


def rotten_tomatoes(
    split: str, batch_size: int, max_len: int = 64, limit: int | None = None, seed: int = 0, by_length: bool = False
):
    """``Batches`` of a split ("train" or "validation"), its first ``limit`` snippets after shuffling.

    ``by_length``: then sort those snippets by their length in characters, so that each batch pads to little
    more than its own snippets (on the validation split, about half the tokens of shuffled batches). For
    scoring: a training run wants every batch to mix lengths."""
    texts, labels = load_classification("rotten_tomatoes", split)
    data = Batches(texts, labels, batch_size, max_len, seed)
    if limit is not None:
        data.texts, data.labels = data.texts[:limit], data.labels[:limit]
    if by_length:
        order = sorted(range(len(data.texts)), key=lambda i: (len(data.texts[i]), i))
        data.texts, data.labels = [data.texts[i] for i in order], [data.labels[i] for i in order]
    return data


def new_classifier(num_hidden_layers: int = 6):
    """all-MiniLM-L6-v2 with a fresh 2-way head (seeded by the caller), optionally cut to its first layers."""
    import transformers
    from transformers import BertForSequenceClassification

    transformers.logging.set_verbosity_error()  # the loading report would list the head we add
    transformers.utils.logging.disable_progress_bar()
    model = BertForSequenceClassification.from_pretrained(
        reference_files("all-minilm-l6-v2")["config.json"].parent, num_labels=2, num_hidden_layers=num_hidden_layers
    )
    model.config.problem_type = "single_label_classification"
    return model


def classification_loss(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, 2)
    return torch.nn.functional.cross_entropy(logits, batch["labels"])


def _path(recipe: Recipe):
    return cache_dir() / "compress" / f"minilm-rt-{recipe.key()}.safetensors"


def is_cached(recipe: Recipe) -> bool:
    """Whether ``recipe``'s model is in the cache and matches its recorded sha256."""
    return read_derived(_path(recipe)) is not None


def lesson_base(fast: bool, verbose: bool = True):
    """(model, recipe) for lesson 22 and the benchmark: ``Recipe()``'s model when it is cached or
    ``fast`` is False (then it is trained), else the shipped one (``SHIPPED``); ``verbose`` prints which."""
    if not fast or is_cached(Recipe()):
        recipe, model = Recipe(), None
    else:
        recipe, model = SHIPPED, shipped_base()
    if verbose:
        which = "the full recipe" if recipe == Recipe() else "fast mode's shipped base (the full recipe is not cached)"
        print(f"base: {which}, {recipe} ({recipe.method})", flush=True)
    return (finetuned_classifier(recipe, verbose) if model is None else model), recipe


def shipped_base(folder=None):
    """Fast mode's base, in eval mode: all-MiniLM-L6-v2 with the shipped adapter ``SHIPPED.adapter`` merged.

    Its file is checked against its record (size, sha256) and read as safetensors (``load_shipped``); the
    result is a plain ``BertForSequenceClassification`` whose every parameter trains, like ``Recipe()``'s.
    ``folder``: where the adapter and its record are (default ``data/adapters/``)."""
    from ..peft.lora import merge_and_unload
    from ..peft.shipped import load_shipped, lora_model

    torch.manual_seed(SHIPPED.seed)
    model = lora_model(new_classifier())
    load_shipped(model, SHIPPED.adapter, folder)
    model = merge_and_unload(model)
    for p in model.parameters():
        p.requires_grad_(True)  # the merge keeps LoRA's frozen base; the compression methods fine-tune all
    return model.eval()


def finetuned_classifier(recipe: Recipe = Recipe(), verbose: bool = True):
    """The fine-tuned model of ``recipe``, in eval mode: from the cache, or trained now and cached.

    The cached file is read as safetensors (plain tensors, never unpickled) and only while its sha256
    matches the one recorded beside it."""
    from ..train.loop import TrainConfig, train

    path = _path(recipe)
    torch.manual_seed(recipe.seed)
    model = new_classifier()
    cached = read_derived(path)
    if cached is not None:
        model.load_state_dict(load_safetensors(cached))
        return model.eval()
    if verbose:
        print(
            f"fine-tuning all-MiniLM-L6-v2 on Rotten Tomatoes ({recipe.steps} steps); cached as compress/{path.name} in the data cache",
            flush=True,
        )
    data = rotten_tomatoes("train", recipe.batch_size, recipe.max_len, seed=recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    train(model, optimizer, data.__getitem__, classification_loss, TrainConfig(max_steps=recipe.steps, progress=False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    write_derived(path, save_safetensors(state))
    return model.eval()


@torch.no_grad()
def accuracy(model, data: Batches) -> float:
    """Fraction of ``data``'s snippets whose argmax logit is the label (one pass, eval mode)."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(len(data)):
        b = data[i]
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # (B, 2)
        correct += (logits.argmax(-1) == b["labels"]).sum().item()
    model.train(was_training)
    return correct / len(data.texts)


def state_bytes(model) -> int:
    """Bytes of ``model``'s state dict as one safetensors file (what ``save_file`` would write)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return len(save_safetensors(state))
