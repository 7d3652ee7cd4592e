"""The router's view of the KV store: which leading blocks of a prompt the store holds.

Lifecycle: `StoreIndex(master_addr, ...)` opens the store client (connector/kvstore, the same
client the engines use: its lookup deadline, the engines' block keys, mutual TLS with the
router's certificate when on) on the router's loop; `close()` closes it. Only metadata is asked (PrefixLookup), never bytes. A
lookup that fails or is slow counts as "nothing stored": the request then takes the full
prefill path, which is always correct, only slower.
"""

from __future__ import annotations

import functools
import logging

from pdserve.common.telemetry.metrics import RouterMetrics
from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.services.common.tls import TlsConfig, open_channel

log = logging.getLogger(__name__)


class StoreIndex:
    def __init__(self, master_addr: str, metrics: RouterMetrics, timeout_s: float,
                 block_secret_file: str = "", tls: TlsConfig = TlsConfig()):
        self.master_addr = master_addr
        self._client = KVStoreClient.for_engines(
            master_addr, StoreClientConfig(lookup_timeout_s=timeout_s,
                                           block_secret_file=block_secret_file),
            functools.partial(open_channel, tls=tls, server_role="kvstore-master"))
        self._metrics = metrics

    async def close(self) -> None:
        await self._client.close()

    async def stored_prefix(self, keys: list[bytes]) -> int:
        """How many leading `keys` the store holds; 0 when it cannot say."""
        if not keys:
            return 0
        self._metrics.kv_lookups.inc()
        try:
            return await self._client.prefix_lookup(keys)
        except Exception as err:  # noqa: BLE001 - unavailable, refused, slow: all mean "none"
            self._metrics.kv_lookup_failures.inc()
            log.warning("KV store lookup at %s failed: %s", self.master_addr, err)
            return 0
