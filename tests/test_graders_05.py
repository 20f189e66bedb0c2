"""Lesson 05's graders: the next-token loss (the lesson's "find the bug") and its predictions, the LLaMA FLOP count
and its crossover length, the GPT-2 parameter count. A right answer passes; the bug itself, other plausible wrong
values, and right values computed the wrong way (the library's count, a model built on `meta`) fail."""

import dataclasses

import torch
import torch.nn.functional as F

from llmedu.checks.anatomy import check_next_token_loss
from llmedu.checks.models import (
    check_attention_crossover,
    check_gpt2_parameters,
    check_llama_flops,
    check_unshifted_predictions,
    llama_matmul_parameters,
)
from llmedu.models import CausalLM, TransformerConfig
from llmedu.models.counting import flops_per_token, matmul_parameters
from llmedu.models.gpt import lm_loss


def shifted(logits, ids):
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def test_right_answers_pass():
    assert check_next_token_loss(shifted)

    def by_hand(logits, ids):  # log_softmax and a gather: the same loss, written out
        logp = logits[:, :-1].log_softmax(-1)  # (B, T-1, V)
        return -logp.gather(-1, ids[:, 1:, None]).mean()

    assert check_next_token_loss(by_hand)


def test_plausible_wrong_values_fail():
    V = lambda x: x.shape[-1]  # noqa: E731
    # the bug of the exercise: no shift
    assert not check_next_token_loss(lambda lg, ids: F.cross_entropy(lg.reshape(-1, V(lg)), ids.reshape(-1)))
    # shifted the wrong way
    assert not check_next_token_loss(
        lambda lg, ids: F.cross_entropy(lg[:, 1:].reshape(-1, V(lg)), ids[:, :-1].reshape(-1))
    )
    # a sum instead of a mean
    assert not check_next_token_loss(
        lambda lg, ids: F.cross_entropy(lg[:, :-1].reshape(-1, V(lg)), ids[:, 1:].reshape(-1), reduction="sum")
    )


def test_right_values_computed_the_wrong_way_fail():
    # the library's loss: right values, but the exercise asks for the shift written out
    assert not check_next_token_loss(lm_loss)

    def softmax_then_log(logits, ids):  # right on small logits; -inf on logits of a few hundred
        p = logits[:, :-1].softmax(-1)
        return -p.gather(-1, ids[:, 1:, None]).log().mean()

    assert not check_next_token_loss(softmax_then_log)
    # and the grader's case really is the one that breaks it: a right answer on the same inputs is finite
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(5)) * 200
    ids = torch.randint(0, 7, (2, 5))
    assert torch.isfinite(shifted(logits, ids))


# -- exercise 1: the LLaMA count, by hand ---------------------------------------------------------------
def llama_flops(V, d, L, H, H_kv, d_ff, T):  # a right answer: q, o of d x d; k, v of d x H_kv D; 3 SwiGLU; output
    n = L * (2 * d * d + 2 * d * H_kv * (d // H) + 3 * d * d_ff) + d * V
    return 6 * n + 12 * L * T * d


def test_llama_flops_by_hand_passes():
    assert check_llama_flops(llama_flops)


def test_llama_flops_from_the_library_fails(capsys):
    def from_library(V, d, L, H, H_kv, d_ff, T):  # right values: the lesson's own count on a meta model
        cfg = TransformerConfig.llama(vocab_size=V, d_model=d, n_layers=L, n_heads=H, n_kv_heads=H_kv, d_ff=d_ff)
        with torch.device("meta"):
            model = CausalLM(cfg)
        return flops_per_token(cfg, matmul_parameters(model), seq_len=T)

    assert not check_llama_flops(from_library)
    assert "count by hand" in capsys.readouterr().out
    # the grader's own reference is a shortcut too
    assert not check_llama_flops(
        lambda V, d, L, H, Hk, dff, T: 6 * llama_matmul_parameters(V, d, L, H, Hk, dff) + 12 * L * T * d
    )
    # a plausible wrong value: GQA applied to the attention term as well
    assert not check_llama_flops(
        lambda V, d, L, H, Hk, dff, T: llama_flops(V, d, L, H, Hk, dff, T) - 12 * L * T * d * (1 - Hk / H)
    )


def test_attention_crossover():
    assert check_attention_crossover(25_204)
    assert check_attention_crossover(25_000)  # rounded: within 1%
    n_all = 6_738_415_616  # every parameter, the embedding table too
    for wrong in (n_all / (2 * 32 * 4096), 24_704, 6 * 4096, 50_408, 4096, "25204"):
        assert not check_attention_crossover(wrong), wrong


# -- exercise 2: the predictions --------------------------------------------------------------------------
def test_unshifted_predictions(capsys):
    assert check_unshifted_predictions(0.01, "b", "c")
    assert check_unshifted_predictions(0, " B ", "C")
    assert not check_unshifted_predictions(2.0, "b", "c")  # "somewhat better than the bigram"
    assert not check_unshifted_predictions(5.55, "b", "c")  # ln 256: "it learns nothing"
    assert not check_unshifted_predictions(0.01, "a", "c")
    assert not check_unshifted_predictions(0.01, "d", "c")
    assert not check_unshifted_predictions(0.01, "b", "b")
    assert not check_unshifted_predictions(0.01, "b", "e")
    assert "one of the letters" in capsys.readouterr().out


# -- exercise 3: the GPT-2 count, without building ----------------------------------------------------------
def gpt2_parameters(V, T, d, L, f, tied):
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 2 * 2 * d  # attention, FFN, two LayerNorms
    return V * d + T * d + L * block + 2 * d + (0 if tied else V * d)


def test_gpt2_parameters_built_on_meta_fails(capsys):
    assert check_gpt2_parameters(gpt2_parameters)

    def built_on_meta(V, T, d, L, f, tied):  # the lesson's own cell: right values, by building
        cfg = TransformerConfig.gpt2(vocab_size=V, max_seq_len=T, d_model=d, n_layers=L, n_heads=1, d_ff=f)
        cfg = dataclasses.replace(cfg, tie_embeddings=tied)
        with torch.device("meta"):
            return sum(p.numel() for p in CausalLM(cfg).parameters())

    assert not check_gpt2_parameters(built_on_meta)
    assert "calls config.TransformerConfig.gpt2" in capsys.readouterr().out

    def transformers_on_meta(V, T, d, L, f, tied):
        import transformers as tf

        config = tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=d, n_layer=L, n_head=1, n_inner=f)
        config.tie_word_embeddings = tied
        with torch.device("meta"):
            return tf.GPT2LMHeadModel(config).num_parameters()

    assert not check_gpt2_parameters(transformers_on_meta)
    assert "count by hand" in capsys.readouterr().out

    def torch_layers(V, T, d, L, f, tied):  # the same shapes as torch.nn layers on meta
        with torch.device("meta"):
            parts = [torch.nn.Embedding(V, d), torch.nn.Embedding(T, d), torch.nn.LayerNorm(d)]
            parts += [torch.nn.Linear(d, d) for _ in range(4 * L)] + [torch.nn.LayerNorm(d) for _ in range(2 * L)]
            parts += [torch.nn.Linear(d, f) for _ in range(L)] + [torch.nn.Linear(f, d) for _ in range(L)]
            parts += [] if tied else [torch.nn.Linear(d, V, bias=False)]
            return sum(p.numel() for m in parts for p in m.parameters())

    assert torch_layers(101, 64, 96, 2, 136, True) == gpt2_parameters(101, 64, 96, 2, 136, True)
    assert not check_gpt2_parameters(torch_layers)
    assert not check_gpt2_parameters(lambda V, T, d, L, f, tied: gpt2_parameters(V, T, d, L, f, tied) - L * 2 * 2 * d)


def test_each_answer_is_one_case():
    # three answers, three cases, right or wrong: the third answer's failure is case 3
    assert "all 3 cases" in str(check_unshifted_predictions(0.01, "b", "c"))
    wrong = check_unshifted_predictions(0.01, "b", "b")
    assert not wrong and "case 3 of the check" in str(wrong) and wrong.failure.startswith("why")
    # a check of one case says so in the singular
    assert "the one case agrees" in str(check_attention_crossover(25_204))
    # every-parameter N (the embedding table and the norms) hears the embedding-table hint
    everything = check_attention_crossover(6_738_415_616 / (2 * 32 * 4096))
    assert not everything and "embedding table" in everything.failure
