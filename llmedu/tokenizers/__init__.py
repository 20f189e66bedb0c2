"""Tokenizers from scratch: byte-level BPE (GPT-2), WordPiece (BERT), Unigram (SentencePiece).

base        the shared interface: train / encode / decode / save / load / save_hf
pairs       pair counts kept current while merging (what makes BPE training fast)
bpe         byte-level BPE: a naive reference trainer and the fast one; ``from_gpt2`` encodes exactly like GPT-2
bpe_files   GPT-2's encoder.json / vocab.bpe and Hugging Face's tokenizer.json for BPE
basic       BERT's basic tokenizer: normalisation and the split into words, before WordPiece
wordpiece   greedy longest-match WordPiece and its trainer; ``from_vocab`` = bert-base-uncased
unigram     Kudo's unigram language model: EM, Viterbi, pruning, sampled segmentations
"""

from .base import Tokenizer
from .bpe import BPETokenizer
from .unigram import UnigramTokenizer
from .wordpiece import WordPieceTokenizer

__all__ = ["Tokenizer", "BPETokenizer", "WordPieceTokenizer", "UnigramTokenizer"]
