"""The bench client splits an event stream at \\n / \\r only: a token's raw U+2028 or U+0085
inside a JSON string must not cut its chunk (httpx's aiter_lines did: a JSONDecodeError)."""

import asyncio
import json

from pdserve.bench.sse import sse_lines


def test_lines_split_at_newlines_only_even_across_byte_chunks():
    event = json.dumps({"choices": [{"text": "a\u2028b\x85c\x1ed"}]}, ensure_ascii=False)
    raw = f"data: {event}\r\n\r\ndata: [DONE]\n\n".encode()

    async def lines():
        async def chunks():  # split inside a multi-byte character and inside \r\n
            for i in range(0, len(raw), 7):
                yield raw[i:i + 7]
        return [line async for line in sse_lines(chunks())]

    got = asyncio.run(lines())
    assert got == [f"data: {event}", "", "data: [DONE]", ""]
    assert json.loads(got[0][6:])["choices"][0]["text"] == "a\u2028b\x85c\x1ed"
