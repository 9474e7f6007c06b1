"""Incremental detokenization against the one-shot decode: the streamed deltas, concatenated, equal
`tokenizer.decode(ids)` (cut before the first stop string), for random token sequences — valid and
invalid UTF-8, characters split across tokens — with the byte tokenizer and a byte-level BPE
tokenizer; and no streamed text is ever cut later."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seekforge.model.tokenizer import ByteTokenizer, HFTokenizer
from seekforge.serve.detokenizer import IncrementalDetokenizer

# Multi-byte text so BPE learns merges that end inside a character (é, €, 漢, 😀 are 2, 3, 3, 4 bytes).
CORPUS = ["héllo wörld, ça coûte 5 € ou 10 €", "漢字とかなの混じった文", "smile 😀😀 and wave 👋",
          "plain ascii text"] * 20


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("bpe")
    tk.save(str(path / "tokenizer.json"))
    return HFTokenizer(path)


def reference_text(tokenizer, ids: list[int], stop: list[str]) -> str:
    """One-shot decode, cut before the stop string whose match ends first (ties: the longer one)."""
    text = tokenizer.decode(ids)
    matches = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    return text[:min(matches)[1]] if matches else text


def stream(tokenizer, ids: list[int], stop: list[str]) -> list[str]:
    """The deltas a client receives: one per token, then the rest when the sequence ends."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    sent, deltas = "", []
    for token_id in ids:
        stopped = detok.add(token_id)
        if stopped:
            break
        now = detok.streamable_text
        assert now.startswith(sent), "streamed text changed after it was sent"
        deltas.append(now[len(sent):])
        sent = now
    detok.finish()
    assert detok.text.startswith(sent), "text already streamed was cut later"
    deltas.append(detok.text[len(sent):])
    return deltas


def token_ids(vocab_size: int, multibyte_ids: list[int]):
    """Random ids (often invalid UTF-8), or the encoding of random text (characters split across tokens)."""
    any_ids = st.lists(st.integers(0, vocab_size - 1), max_size=40)
    fragments = st.lists(st.sampled_from(multibyte_ids) | st.integers(0, vocab_size - 1), max_size=40)
    return any_ids | fragments


def stop_strings(data, text: str) -> list[str]:
    """Stop strings that occur in the text (so they span tokens and do match) and random ones."""
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if text and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[i:i + data.draw(st.integers(1, 4))])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=3)))
    return stops


BYTE = ByteTokenizer()
MULTIBYTE = list("é€漢😀".encode())  # lead and continuation bytes


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_byte_tokenizer_stream_equals_one_shot_decode(data):
    ids = data.draw(token_ids(BYTE.vocab_size, MULTIBYTE))
    stop = stop_strings(data, BYTE.decode(ids)) if data.draw(st.booleans()) else []
    assert "".join(stream(BYTE, ids, stop)) == reference_text(BYTE, ids, stop)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_bpe_tokenizer_stream_equals_one_shot_decode(bpe_tokenizer, data):
    tok = bpe_tokenizer
    ids = data.draw(token_ids(tok.vocab_size, tok.encode("".join(CORPUS[:3]))))
    stop = stop_strings(data, tok.decode(ids)) if data.draw(st.booleans()) else []
    assert "".join(stream(tok, ids, stop)) == reference_text(tok, ids, stop)


def test_bpe_splits_characters_across_tokens(bpe_tokenizer):
    """The property test above only means something if some tokens end inside a character."""
    partial = [i for i in range(bpe_tokenizer.vocab_size) if bpe_tokenizer.decode([i]).endswith("\ufffd")]
    assert len(partial) > 50


def test_character_split_across_tokens_waits_for_its_last_byte():
    detok = IncrementalDetokenizer(BYTE, [])
    euro = list("€".encode())  # 3 bytes
    for b in [*b"5 ", *euro[:2]]:
        detok.add(b)
    assert detok.text == "5 "  # not "5 \ufffd"
    detok.add(euro[2])
    assert detok.text == "5 €"
    detok.add(euro[0])  # a character that never completes
    detok.finish()
    assert detok.text == "5 €\ufffd" == BYTE.decode([*b"5 ", *euro, euro[0]])


def test_stop_string_spanning_tokens_is_cut_and_never_streamed():
    detok = IncrementalDetokenizer(BYTE, ["END", "€!"])
    shown = []
    for b in b"abc EN":
        assert not detok.add(b)
        shown.append(detok.streamable_text)
    assert shown[-1] == "abc "  # "EN" may become "END": held back
    assert detok.add(ord("D")) and detok.text == "abc "
    detok = IncrementalDetokenizer(BYTE, ["€!"])  # a stop string that starts inside a split character
    for b in "x€".encode():
        detok.add(b)
    assert detok.streamable_text == "x"
    assert detok.add(ord("!")) and detok.text == "x"


def test_min_tokens_lets_a_stop_string_pass():
    detok = IncrementalDetokenizer(BYTE, ["b"])
    assert not detok.add(ord("b"), check_stop=False)
    assert detok.add(ord("b")) and detok.text == "b"


class WordTokenizer:
    """Token i is the i-th two-letter word: one token completes several characters at once."""

    WORDS = ["ab", "cd", "ef"]

    def decode(self, ids):
        return "".join(self.WORDS[i] for i in ids)


def test_stop_strings_completed_by_one_token_cut_at_the_first_to_end():
    # "abcd" arrives as "ab" + "cd": "bc" ends at character 3, "abcd" at 4; a character stream would
    # have stopped at "bc", so the text is "a" whatever the order of the stop list
    for stop in (["bc", "abcd"], ["abcd", "bc"]):
        detok = IncrementalDetokenizer(WordTokenizer(), stop)
        assert not detok.add(0) and detok.add(1) and detok.text == "a"
    detok = IncrementalDetokenizer(WordTokenizer(), ["d", "cd"])  # same end: the longer match wins
    assert not detok.add(0) and detok.add(1) and detok.text == "ab"


def test_engine_streams_the_one_shot_decode(tiny_model):
    """Through the engine: random weights emit arbitrary bytes (split and invalid UTF-8); each step's
    text extends the last, and the final text is the one-shot decode of the output tokens."""
    from seekforge.serve.engine import LLM
    from seekforge.serve.sequence import SamplingParams

    engine = LLM(tiny_model, BYTE, block_size=8, num_kv_blocks=64).engine
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=60, ignore_eos=True)
    engine.add_request([*b"\xe2\x82 caf\xc3"], params)
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index].append(c.text)
    for c in out.outputs:
        steps = texts[c.index]
        assert all(steps[k + 1].startswith(steps[k]) for k in range(len(steps) - 1))
        assert c.text == BYTE.decode(c.token_ids) and len(c.token_ids) == 60
    assert any("\ufffd" in c.text for c in out.outputs) and any(ord(ch) > 127 and ch != "\ufffd"
                                                               for c in out.outputs for ch in c.text)


@pytest.mark.parametrize("skip, text", [(True, "hi"), (False, "h<|pad|>i")])
def test_special_tokens_kept_when_asked(skip, text):
    """skip_special_tokens=False (vLLM's field; the server sets it for tool calls, whose markers are
    special tokens in DeepSeek's tokenizer) keeps their text in the output."""
    detok = IncrementalDetokenizer(BYTE, [], skip_special_tokens=skip)
    for token_id in [104, BYTE.pad_token_id, 105]:
        detok.add(token_id)
    detok.finish()
    assert detok.text == text
