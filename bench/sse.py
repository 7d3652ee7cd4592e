"""Reading one OpenAI streaming chunk into a StreamTrace.

A chunk is a token arrival when it has text, or when it is neither the chat opening (a delta
with a role) nor a bare finish chunk: our router sends a chunk per token even when the token's
text is held back (a partial UTF-8 sequence), while vLLM ends with an empty finish chunk.
"""

from __future__ import annotations

import json

from pdserve.bench.breakdown import BREAKDOWN_KEY
from pdserve.bench.record import StreamTrace


def apply_chunk(trace: StreamTrace, data: str, t: float) -> bool:
    """Applies one `data:` payload received at time t; returns False at [DONE]."""
    if data.strip() == "[DONE]":
        return False
    obj = json.loads(data)
    if "error" in obj and obj["error"]:
        err = obj["error"]
        trace.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return True
    usage = obj.get("usage")
    if usage:
        trace.usage_prompt = usage.get("prompt_tokens")
        trace.usage_completion = usage.get("completion_tokens")
    if obj.get(BREAKDOWN_KEY):
        trace.breakdown = dict(obj[BREAKDOWN_KEY])
    for choice in obj.get("choices") or []:
        if "delta" in choice:
            delta = choice["delta"] or {}
            text, opening = delta.get("content") or "", "role" in delta
        else:
            text, opening = choice.get("text") or "", False
        finish = choice.get("finish_reason") is not None
        if text or not (opening or finish):
            trace.add(t, 1, text)
    return True

