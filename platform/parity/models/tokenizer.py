"""Tokenizers of the embedded models, saved in Hugging Face format so that AutoTokenizer (and vLLM) load
them like any other checkpoint's tokenizer: a character-level one (`model.tokenizer=char`, the default) and
a byte-level BPE trained on the task's corpus (`model.tokenizer=bpe`, `model.tokenizer_vocab_size`)."""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = [PAD, EOS, UNK]
# Printable ASCII and newline: enough for arithmetic and for LaTeX benchmark text (other chars -> <unk>).
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    fast.padding_side = "left"
    return fast


def save_char_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer()
    tok.save_pretrained(str(path))
    return tok


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` (the task's prompts and teacher responses), with the same special
    tokens and left padding as the character tokenizer. Byte-level: every string round-trips, no <unk>.
    `vocab_size` is an upper bound: training stops when no pair of the corpus is left to merge."""
    if vocab_size < len(SPECIALS) + 256:
        raise ValueError(f"config key `model.tokenizer_vocab_size`: a byte-level BPE needs at least "
                         f"{len(SPECIALS) + 256} entries (the specials and 256 bytes), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   clean_up_tokenization_spaces=False)
    fast.padding_side = "left"
    return fast
