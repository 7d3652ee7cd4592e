"""Our SmolLM2 tokenizer gives transformers' GGUF tokenizer's ids; chat templates render alike."""

import jinja2
import pytest

from pdserve.common.models.registry import resolve_model
from pdserve.common.tokenizer import Tokenizer

TEXTS = [
    "Hello world", " Hello", "Hello  world", "12345 678", "3.14159", "1,000,000.00$",
    "héllo wörld", "Ünïcödé ÀÉÎ", "日本語のテキスト", "مرحبا بالعالم", "Привет мир", "한국어 문장",
    "emoji 😀🎉👍🏽", "😀😀😀", "👨‍👩‍👧‍👦 family", "ﬁ ligature", "naïve café", "  leading  spaces",
    "tab\there", "\t\ttabs\n\nnewlines", "\r\n windows", "\n", " ", "   ", "",
    "def f(x):\n    return x**2  # square", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "I'm can't we'll THEY'RE", "http://example.com/a?b=c&d=e", "x=y+z;", "ABC123def456",
    "<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<repo_name>foo", "<think>",
    "trailing space ", "MiXeD CaSe WoRdS", "€£¥ ©®™ ½¼", "a\u00a0b\u2009c", "ǅ ǈ Ω Å",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Tell me a joke"}, {"role": "assistant", "content": "No."},
     {"role": "user", "content": "Please 🙏 — with ünïcode"}],
    [{"role": "user", "content": "code:\n```py\nprint('x')\n```"}],
]


@pytest.fixture(scope="module")
def smollm2_path():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def ours(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf(smollm2_path, gguf_parse_cache):
    from transformers import AutoTokenizer
    with gguf_parse_cache.active():
        return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


def test_ids_match_transformers(ours, hf):
    assert len(TEXTS) >= 30
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids), text


def test_special_tokens(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi")  # GGUF: add_bos false


def test_chat_template_matches_transformers(ours, hf):
    for messages in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=gen)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ours.encode_chat(messages) == ids


def test_from_hf_dir_matches(ours, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == ours.encode(text), text
    chat = CONVERSATIONS[1]
    assert loaded.apply_chat_template(chat) == ours.apply_chat_template(chat)
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (1, (2,))


def test_template_raise_exception_and_sandbox():
    tok = Tokenizer(Tokenizer.tiny().backend, 317, (319,),
                    "{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}"
                    "{{ bos_token }}{{ messages.append(1) }}{{ eos_token }}")
    with pytest.raises(jinja2.TemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable sandbox: no mutation
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_tiny_tokenizer():
    tok = Tokenizer.tiny()
    assert tok.vocab_size == 320 and tok.bos_token_id == 317 and tok.eos_token_ids == (319, 317)
    text = "the cat and you 😀 héllo\n\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 317 and len(ids) < len(text.encode())
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 318 and 319 in ids and tok.decode(ids) == "user\nhi\nassistant\n"
