"""pdserve.client: a small typed Python client for the router's gRPC API (`Router.Generate`,
`Router.Health`), blocking (`Client`) and asyncio (`AsyncClient`).

    from pdserve.client import Client, Sampling

    with Client("127.0.0.1:50050") as c:
        out = c.generate("The capital of France is", sampling=Sampling(max_tokens=16))
        print(out.text, out.finish_reason, out.usage)

The generated protobuf modules it uses live in `pdserve.common.rpc` (router_pb2, engine_pb2).
"""

from pdserve.client.aio import AsyncClient
from pdserve.client.sync import Client
from pdserve.client.types import (ChatMessage, Chunk, ClientError, Completion, FinishReason,
                                  RouterHealth, Sampling, TokenLogprob, Usage)

__all__ = ["AsyncClient", "ChatMessage", "Chunk", "Client", "ClientError", "Completion",
           "FinishReason", "RouterHealth", "Sampling", "TokenLogprob", "Usage"]
