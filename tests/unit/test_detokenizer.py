"""Incremental detokenizer: streamed text never holds a broken character and adds up to decode()."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.models.registry import resolve_model
from pdserve.common.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! 😀🎉 naïve café — 日本語のテキスト",
    "👨‍👩‍👧‍👦 and 👍🏽 and 🇫🇷 flags",
    "مرحبا بالعالم Привет мир 한국어",
    "code:\n    x = 'ü' * 3  # 🐍\n",
    "<|im_start|>user\nhé<|im_end|>\n<|im_start|>assistant\n😀",
]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request):
    if request.param == "tiny":
        return Tokenizer.tiny()
    return Tokenizer.from_gguf(resolve_model("smollm2"))


def _stream(tok, ids, skip=True, step=1):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    chunks = [detok.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    chunks.append(detok.flush())
    return detok, chunks


@pytest.mark.parametrize("skip", [True, False])
def test_one_token_at_a_time(tok, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        detok, chunks = _stream(tok, ids, skip)
        assert not any("\ufffd" in c for c in chunks), (text, chunks)
        assert "".join(chunks) == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_several_tokens_per_push(tok):
    ids = tok.encode(TEXTS[0] + TEXTS[1])
    for step in (2, 3, 7):
        _, chunks = _stream(tok, ids, step=step)
        assert "".join(chunks) == tok.decode(ids)


def test_byte_tokens_are_held_until_the_character_completes():
    tok = Tokenizer.tiny()
    detok = IncrementalDetokenizer(tok)
    emoji = list("😀".encode())  # tiny ids 0-255 are the bytes themselves
    assert [detok.push([b]) for b in emoji] == ["", "", "", "😀"]


def test_invalid_bytes_are_released_by_flush():
    tok = Tokenizer.tiny()
    ids = tok.encode("ok ") + [0x80]  # a lone continuation byte never completes
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(ids)


class _CountingTokenizer:
    """Records the longest slice decoded, to show each step decodes a short window."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_stays_short():
    tok = Tokenizer.tiny()
    ids = tok.encode("the cat 😀 and you " * 200)
    counting = _CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    for i in ids:
        detok.push([i])
    assert detok.text + detok.flush() == tok.decode(ids)
    assert counting.longest <= 8


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_any_text_round_trips_tiny(text):
    tok = Tokenizer.tiny()
    ids = tok.encode(text)
    _, chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in c for c in chunks) or "\ufffd" in text
