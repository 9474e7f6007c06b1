"""The byte tokenizer saved as tokenizer.json: transformers.AutoTokenizer encodes exactly as it does."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seekforge.model.tokenizer import ByteTokenizer, load_tokenizer

# Text with the special tokens' strings mixed in: both sides turn them into their ids.
TEXT = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(ByteTokenizer.SPECIALS)), max_size=6).map("".join)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    ByteTokenizer().save(directory)
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer(exported):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(exported)


def test_autotokenizer_loads_the_byte_tokenizer_with_its_special_ids(exported, hf_tokenizer):
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (256, 257, 258)
    assert len(hf_tokenizer) == ByteTokenizer().vocab_size
    reloaded = load_tokenizer(exported)  # our own loader reads the export as an HF tokenizer
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.vocab_size) == (256, 257, 259)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=TEXT)
def test_encode_and_decode_equal_transformers(hf_tokenizer, text):
    ours = ByteTokenizer()
    ids = ours.encode(text)
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == ours.decode(ids)


def test_pieces_and_bytes_of_single_tokens(exported, hf_tokenizer):
    """Per token: the vocabulary string transformers' convert_ids_to_tokens gives (vLLM's /tokenize), and the bytes
    (logprobs), from the byte tokenizer and from its export read as an HF tokenizer alike."""
    ids = list(range(ByteTokenizer().vocab_size))
    ours, exported_tokenizer = ByteTokenizer(), load_tokenizer(exported)
    assert [ours.piece(i) for i in ids] == [exported_tokenizer.piece(i) for i in ids]
    assert [ours.piece(i) for i in ids] == hf_tokenizer.convert_ids_to_tokens(ids)
    assert [ours.token_bytes(i) for i in ids] == [exported_tokenizer.token_bytes(i) for i in ids]
    assert [ours.token_bytes(i) for i in (104, 195, 257, 300)] == [b"h", b"\xc3", b"<|eos|>", b""]


def test_a_lone_surrogate_is_a_value_error_naming_it(exported):
    """JSON's "\\ud800" decodes to a lone surrogate, which has no UTF-8 form: both tokenizers say so alike (the
    `tokenizers` library's own error was a TypeError, "TextInputSequence must be str")."""
    for tokenizer in (ByteTokenizer(), load_tokenizer(exported)):
        with pytest.raises(ValueError, match=r"lone surrogate .* \(at character 2\)"):
            tokenizer.encode("ok\ud800 there")
        assert tokenizer.encode("ok \U0001f600") == list("ok \U0001f600".encode())  # a pair decodes to one char
