"""Tokenizer: a `tokenizers.Tokenizer` plus special-token ids and a Jinja2 chat template.

Three sources: a GGUF file (vocabulary and merges in metadata, rebuilt the way transformers'
GGUF conversion does, so ids match `AutoTokenizer.from_pretrained(dir, gguf_file=...)`), a Hugging
Face directory (`tokenizer.json` + `tokenizer_config.json`), and a tiny byte-level tokenizer for
tests and the tiny random model.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

import jinja2
import jinja2.ext
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from pdserve.common.models.gguf_file import open_gguf

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer splits for GGUF `tokenizer.ggml.pre` values whose regex differs from GPT-2's
# (as transformers' GGUF_PRE_TOKENIZER_SPLITS). Any other value, e.g. SmolLM2's "smollm", gets
# plain GPT-2 ByteLevel splitting, which is what transformers gives for it.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}

_TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# 61 merges of common English pieces (byte-level spelling: "Ġ" is a space, "Ċ" a newline), so
# the tiny vocabulary is exactly 320 = 256 bytes + 61 merges + 3 specials and has multi-byte tokens.
_TINY_MERGES = tuple(tuple(m.split()) for m in (
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o", "e n",
    "n d", "i t", "o u", "e s", "Ġ c", "i s", "o r", "a n", "Ġ b", "e d", "Ġ f", "in g", "Ġ p",
    "a l", "Ġ m", "a r", "l e", "Ġ d", "Ġ h", "Ġa nd", "Ġ i", "Ġo f", "Ġ l", "Ġt o", "Ġ n", "l l",
    "Ġ e", "Ġ g", "s t", "Ġ r", "v e", "c h", "Ġ y", "Ġ 1", "o m", "i c", "Ġi n", "l y", "Ġ T",
    "Ġ I", "Ġ A", "Ċ Ċ", "Ġ Ġ", "ĠĠ ĠĠ", "e l", "Ġ u", "o w", "Ġy ou"))
_TINY_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE tokens)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    def __init__(self, backend: _Backend, bos_token_id: Optional[int],
                 eos_token_ids: Sequence[int], chat_template: Optional[str] = None):
        self._backend = backend
        self._bos = bos_token_id
        self._eos = tuple(dict.fromkeys(eos_token_ids))
        self._template_source = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path, reader: GGUFReader | None = None) -> "Tokenizer":
        """`reader`: the file already open (`open_gguf(path)`), to parse it once per start."""
        meta = _gguf_tokenizer_metadata(reader or open_gguf(path))
        if meta.get("model") != "gpt2":
            raise ValueError(f"GGUF {path}: tokenizer model {meta.get('model')!r} is not "
                             "supported (only byte-level BPE, 'gpt2')")
        backend = _byte_level_bpe(meta["tokens"], meta["merges"], meta.get("pre"))
        _add_gguf_specials(backend, meta["tokens"], meta.get("token_type") or ())
        bos = meta.get("bos_token_id")
        if meta.get("add_bos_token") and bos is not None:
            _prepend_bos(backend, meta["tokens"][bos], bos)
        eos = [meta[k] for k in ("eos_token_id", "eot_token_id") if meta.get(k) is not None]
        return cls(backend, bos, eos, meta.get("chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        bos = _token_id(backend, cfg.get("bos_token"))
        # generation_config may list several stop ids (e.g. Llama 3's <|eot_id|>).
        gen_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos = [_token_id(backend, cfg.get("eos_token"))] + _as_list(gen_eos)
        return cls(backend, bos, [e for e in eos if e is not None], _hf_chat_template(path, cfg))

    @classmethod
    def tiny(cls) -> "Tokenizer":
        """Byte-level BPE: ids 0-255 are bytes, 256-316 merges, then <|endoftext|> (317, bos),
        <|im_start|> (318), <|im_end|> (319)."""
        alphabet = _bytes_to_unicode()
        vocab = {alphabet[b]: b for b in range(256)}
        for left, right in _TINY_MERGES:
            vocab[left + right] = len(vocab)
        backend = _Backend(models.BPE(vocab=vocab, merges=list(_TINY_MERGES)))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t in _TINY_SPECIALS])
        bos, _, im_end = (backend.token_to_id(t) for t in _TINY_SPECIALS)
        return cls(backend, bos, (im_end, bos), _TINY_TEMPLATE)

    # ---- queries ------------------------------------------------------------------------------

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (for saving, offsets, batch encoding)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def chat_template(self) -> Optional[str]:
        return self._template_source

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str) -> list[int]:
        """`encode(text)`, through the Rust batch entry point, which releases the GIL while it
        runs (`encode` holds it), so other Python threads go on meanwhile; about 0.1 ms dearer
        per call, worth it for long texts tokenized off an event loop."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self._bos),
            eos_token=self._special_text(self._eos[0] if self._eos else None), **extra)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes every special token it wants; adding more would double BOS.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)

    def _special_text(self, token_id: Optional[int]) -> str:
        return "" if token_id is None else (self.id_to_token(token_id) or "")


# ---- helpers ----------------------------------------------------------------------------------

def _gguf_tokenizer_metadata(reader: GGUFReader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml."):
            meta[key.removeprefix("tokenizer.ggml.")] = field.contents()
    if "tokenizer.chat_template" in reader.fields:
        meta["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    if "tokens" not in meta:
        raise ValueError("GGUF has no tokenizer.ggml.tokens")
    return meta


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> _Backend:
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())
    # Tokens outside the byte alphabet (rare llama.cpp spellings) are respelled byte by byte,
    # as transformers' GGUF conversion does, so merges that mention them still resolve.
    vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                  continuing_subword_prefix="", end_of_word_suffix="",
                                  fuse_unk=False))
    split = _GGUF_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_gguf_specials(backend: _Backend, tokens: list[str], token_types: Sequence[int]) -> None:
    letters = set(_bytes_to_unicode().values())
    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; transformers
    # skips it, and so do we (adding it would grow the vocabulary past the model's).
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= letters]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _prepend_bos(backend: _Backend, bos_text: str, bos_id: int) -> None:
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B",
        special_tokens=[(bos_text, bos_id)])


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _token_id(backend: _Backend, token) -> Optional[int]:
    if isinstance(token, dict):  # tokenizer_config may store an AddedToken as a dict
        token = token.get("content")
    return backend.token_to_id(token) if token else None


def _hf_chat_template(path: Path, cfg: dict) -> Optional[str]:
    jinja_file = path / "chat_template.jinja"  # transformers >= 4.50 saves it separately
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: pick "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; HF templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers' `_compile_jinja_template`, so templates render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
