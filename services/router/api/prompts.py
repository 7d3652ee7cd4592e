"""Prompts to token ids: the router tokenizes and applies the chat template itself."""

from __future__ import annotations

from typing import Optional

from pdserve.services.router.api.errors import bad_request, context_too_long
from pdserve.services.router.api.openai_protocol import MESSAGE_UNSUPPORTED

MAX_PROMPTS = 64  # a completions batch; prompts x n is bounded by max_n as well
# A text at least this long is tokenized through the Rust batch entry point, which releases
# the GIL while it runs (plain `encode` holds it: a 44k-token prompt held it 398 ms), so a job
# built on a worker thread (http_app, grpc_servicer) leaves the event loop free meanwhile.
# Shorter texts take `encode`: the batch call costs about 0.1 ms more.
LONG_TEXT_CHARS = 4096
# A request body this large builds its job (tokenizes) on a worker thread, off the event loop.
OFF_LOOP_BODY_BYTES = LONG_TEXT_CHARS


def encode_text(tokenizer, text: str) -> list[int]:
    """The tokenizer's `encode` (no special tokens added); see LONG_TEXT_CHARS."""
    if len(text) < LONG_TEXT_CHARS:
        return tokenizer.encode(text)
    return tokenizer.encode_releasing_gil(text)


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """OpenAI's `prompt`: a string, strings, token ids, or lists of token ids. One list of
    token ids is one prompt (its length is the prompt's, bounded by the model length later);
    a list of strings or of id lists is a batch of at most MAX_PROMPTS."""
    if isinstance(prompt, str):
        prompts = [encode_text(tokenizer, prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt may list at most {MAX_PROMPTS} prompts", param="prompt")
    elif all(isinstance(p, str) for p in prompt):
        prompts = [encode_text(tokenizer, p) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise bad_request("prompt must not be empty", param="prompt")
    return prompts


def chat_prompt(messages: list[dict], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    try:  # what Tokenizer.encode_chat does: the template writes every special token itself
        ids = encode_text(tokenizer, tokenizer.apply_chat_template(messages,
                                                                   add_generation_prompt))
    except ValueError as exc:  # no template, or the template raised
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
    if not ids:
        raise bad_request("messages produced an empty prompt", param="messages")
    return ids


def message_dicts(messages) -> list[dict]:
    """Typed chat messages to the dicts the template reads; text parts are joined. Tool and
    audio turns and non-text parts are refused with a 400 naming them."""
    out = []
    for i, m in enumerate(messages):
        for name in MESSAGE_UNSUPPORTED:
            if getattr(m, name) not in (None, [], ""):
                raise bad_request(f"messages[{i}].{name} is not supported by this server",
                                  param=f"messages.{i}.{name}", code="unsupported_parameter")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are "
                                      f"supported, got type {part.type!r}",
                                      param=f"messages.{i}.content.{j}",
                                      code="unsupported_parameter")
            content = "".join(part.text for part in content)
        out.append({"role": m.role, "content": content or ""})
    return out


def check_length(prompts: list[list[int]], max_model_len: Optional[int], param: str) -> None:
    if max_model_len is None:
        return  # not known yet: the instance checks it
    for ids in prompts:
        if len(ids) >= max_model_len:
            raise context_too_long(len(ids), max_model_len, param)
