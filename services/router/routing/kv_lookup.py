"""The router's view of the KV store: which leading blocks of a prompt the store holds.

Lifecycle: `StoreIndex(master_addr, ...)` opens one gRPC channel to the store master (on the
router's loop); `close()` closes it. Only metadata is asked (PrefixLookup), never bytes. A
lookup that fails or is slow counts as "nothing stored": the request then takes the full
prefill path, which is always correct, only slower.
"""

from __future__ import annotations

import logging

import grpc

from pdserve.common.rpc import kvstore_pb2 as kv_pb
from pdserve.common.rpc import kvstore_pb2_grpc as kv_grpc
from pdserve.common.telemetry.metrics import RouterMetrics

log = logging.getLogger(__name__)


class StoreIndex:
    def __init__(self, master_addr: str, metrics: RouterMetrics, timeout_s: float):
        self.master_addr = master_addr
        self._channel = grpc.aio.insecure_channel(master_addr)
        self._stub = kv_grpc.KVStoreMasterStub(self._channel)
        self._metrics = metrics
        self._timeout_s = timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def stored_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` the store holds; 0 when it cannot say."""
        if not keys:
            return 0
        self._metrics.kv_lookups.inc()
        try:
            resp = await self._stub.PrefixLookup(kv_pb.PrefixLookupRequest(keys=keys),
                                                 timeout=self._timeout_s)
        except grpc.aio.AioRpcError as err:
            self._metrics.kv_lookup_failures.inc()
            log.warning("KV store lookup at %s failed: %s", self.master_addr, err.code().name)
            return 0
        return min(resp.count, len(keys))
