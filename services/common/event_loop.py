"""The event loop the services run on: uvloop (libuv) instead of asyncio's selector loop.

Why: on a 2-core host the router's and the engine host's event loops share the cores with the
forward, and their CPU per streamed token (call_soon, transports, timers) adds to every step's
time. uvloop does the same work in C; it is a real dependency (uvicorn[standard]'s), not an
option, so there is one loop to reason about.
"""

from __future__ import annotations

from typing import Any, Coroutine, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on a fresh uvloop loop."""
    return uvloop.run(main)
