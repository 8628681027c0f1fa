"""Bytes of text per token (tokenizer/token_bytes.py), what bits per byte divides by."""

from tokenizers import pre_tokenizers

from tokenizer import batched, train_tokenizer
from tokenizer.special import EOT
from tokenizer.token_bytes import byte_level_alphabet, token_byte_counts

TEXT = "Naïve café in 東京, tabs\tand\nnewlines, an emoji 🎉 and   spaces. " * 3


def test_the_alphabet_is_byte_level_bpes_one_character_per_byte():
    alphabet = byte_level_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["A"] == ord("A")


def test_the_tokens_of_a_text_count_its_utf8_bytes_and_special_tokens_none(small_docs):
    tokenizer = train_tokenizer("bpe", batched([*small_docs, TEXT]), vocab_size=600)
    counts = token_byte_counts(tokenizer)
    for text in (TEXT, small_docs[0], "ü" * 5, "🎉"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert counts[ids].sum() == len(text.encode("utf-8")), text[:40]
    assert counts[tokenizer.token_to_id(EOT)] == 0


def test_a_wordpiece_vocabulary_has_no_exact_byte_counts(small_docs):
    assert token_byte_counts(train_tokenizer("wordpiece", batched(small_docs), 800)) is None
