"""Deadlines on the store path against a live store: a SIGSTOPped storage node cannot hold a
put past its deadline; the put is revoked and the master frees its space at once."""

import asyncio
import os
import signal

import pytest

from pdserve.connector.kvstore.client import KVStoreClient, StoreClientConfig
from pdserve.connector.kvstore.errors import KVStoreUnavailable
from pdserve.connector.kvstore.records import PutStatus
from pdserve.tests.integration.kvstore_cluster import secured_cluster

BIG = bytes(6 << 20)  # more than the socket buffers hold: the write must block


def test_put_to_a_stopped_node_ends_at_its_deadline_and_frees_its_blocks(tmp_path):
    cfg = StoreClientConfig(transport="tcp", put_timeout_s=1.0, get_timeout_s=1.0,
                            connect_timeout_s=1.0, lookup_timeout_s=2.0)

    async def main(maddr, node):
        async with KVStoreClient(maddr, config=cfg) as kv:
            assert await kv.put(b"before", b"x" * 4096, lease_s=60) is PutStatus.OK
            used = (await kv.stats()).nodes[0].used
            os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                with pytest.raises(KVStoreUnavailable, match="timed out"):
                    await kv.put(b"stuck", BIG, lease_s=60)
                assert await kv.batch_exists([b"stuck"]) == [False]
                assert (await kv.stats()).nodes[0].used == used  # revoked: space freed
                with pytest.raises(KVStoreUnavailable, match="timed out"):
                    await kv.get(b"before")  # a read has its deadline too
            finally:
                os.kill(node.proc.pid, signal.SIGCONT)
            assert await kv.get(b"before") == b"x" * 4096  # the node is fine afterwards

    # a long node timeout: the stopped node must not be dropped for missing heartbeats
    with secured_cluster(tmp_path, master_args=["--node-timeout", "60"]) as (maddr, _, nodes, _):
        asyncio.run(asyncio.wait_for(main(maddr, nodes["n0"]), 30))
