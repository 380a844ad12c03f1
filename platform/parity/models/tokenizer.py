"""Character-level tokenizer for the embedded default model, saved in Hugging Face format so that
AutoTokenizer (and vLLM) load it like any other checkpoint's tokenizer."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
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
