"""The byte-level BPE that `prepare` trains on the task's corpus: every corpus string round-trips, it is saved in
Hugging Face format (AutoTokenizer loads it), is cached by what it was trained on, and its size is bounded."""

from __future__ import annotations

import pytest

from parity.models.tokenizer import build_bpe_tokenizer


def test_bpe_round_trips_the_corpus_and_loads_with_autotokenizer(quick_cfg, tmp_path) -> None:
    from transformers import AutoTokenizer

    from parity.models.prepare import prepare_tokenizer, tokenizer_corpus

    cfg = quick_cfg("experiment=countdown_tiny", "model.tokenizer_corpus_size=400", f"outputs_dir={tmp_path}")
    corpus = tokenizer_corpus(cfg)
    assert len(corpus) == 400 and all("\\boxed{" in t for t in corpus)
    tok = prepare_tokenizer(cfg)
    assert 256 + 3 <= len(tok) <= 2048
    for text in corpus:  # byte-level: lossless, no <unk>
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    assert len(tok("Use 3 5 7 to make 22.\n")["input_ids"]) < len("Use 3 5 7 to make 22.\n")  # merges happened
    # cached under outputs/tokenizers/bpe-<hash>: a second call loads the same files; AutoTokenizer loads them
    cached = list((tmp_path / "tokenizers").glob("bpe-*"))
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()
    again = AutoTokenizer.from_pretrained(str(cached[0]))
    assert again.get_vocab() == tok.get_vocab() and again.padding_side == "left"
    assert (again.pad_token, again.eos_token) == ("<pad>", "<eos>")
    other = prepare_tokenizer(quick_cfg("experiment=countdown_tiny", "model.tokenizer_corpus_size=300",
                                        f"outputs_dir={tmp_path}"))
    assert len(list((tmp_path / "tokenizers").glob("bpe-*"))) == 2 and other is not None


def test_bpe_refuses_a_vocabulary_below_the_bytes() -> None:
    with pytest.raises(ValueError, match="model.tokenizer_vocab_size"):
        build_bpe_tokenizer(["abc"], 100)
    small = build_bpe_tokenizer(["3+5=8 8*2=16 no", "3*5=15 15+7=22 yes"] * 50, 300)
    assert len(small) <= 300 and small.decode(small("9-4=5 yes")["input_ids"]) == "9-4=5 yes"
