"""Fixtures shared by the per-rank KV transfer tests over the real store."""

import pytest

from pdserve.connector.io_thread import IOThread
from pdserve.services.kvstore.config import MasterConfig, NodeConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.services.kvstore.node import start_node

MiB = 1 << 20


@pytest.fixture
def cluster(redis_url, tmp_path):
    """(master address, block secret file): master and two nodes on their own loop thread."""
    secret = tmp_path / "store.secret"
    secret.write_text("cd" * 32)
    secret.chmod(0o600)
    blocks = tmp_path / "block.secret"
    blocks.write_text("ef" * 32)
    blocks.chmod(0o600)
    io = IOThread("store-servers")

    async def up():
        master = await start_master(MasterConfig(port=0, redis_url=redis_url,
                                                 namespace=f"t:{tmp_path.name}",
                                                 store_secret_file=str(secret)))
        addr = f"127.0.0.1:{master.port}"
        nodes = [await start_node(NodeConfig(master_addr=addr, capacity=16 * MiB,
                                             node_id=f"n{i}", transport="tcp",
                                             store_secret_file=str(secret)))
                 for i in range(2)]
        return master, nodes

    master, nodes = io.run(up(), 60)

    async def down():
        for n in nodes:
            await n.stop()
        await master.stop(0)

    try:
        yield f"127.0.0.1:{master.port}", str(blocks)
    finally:
        io.run(down(), 60)
        io.close()
