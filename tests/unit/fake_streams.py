"""A canned engine stream for router dispatch tests: yields the given Deltas, then ends."""

from pdserve.services.router.dispatch.engine_stream import Delta


class CannedStream:
    def __init__(self, deltas):
        self._deltas = list(deltas)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)

    def cancel(self):
        pass


def delta(tokens, finish=None) -> Delta:
    """A Delta of `tokens` (one character of text per token), ending with `finish` if given."""
    return Delta("x" * len(tokens), tuple(tokens), (), finish, 3, 0, len(tokens))
