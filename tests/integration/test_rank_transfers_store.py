"""Per-rank transfers over the real KV store (an in-process master on Redis and two storage
nodes, store and block secrets on): each tensor-parallel rank has its own store client and I/O
thread, opened from the same pickled `KVStoreSettings` (paths, no secret: each rank reads the
block secret from its file, as a worker process would), and puts / gets only its own heads'
objects; a block one layout wrote is a store hit for another layout, read back exactly."""

import pickle
import time

import pytest
import torch

from pdserve.common.engine.kv_rank_messages import BlockRef, Transfer
from pdserve.connector.codec import BlockCodec
from pdserve.connector.head_objects import HeadObjects, RankHeads
from pdserve.connector.io_thread import IOThread
from pdserve.connector.rank_transfers import Completions, RankTransfers
from pdserve.services.engine_host.kv_connector_factory import KVStoreSettings
from pdserve.services.kvstore.config import MasterConfig, NodeConfig
from pdserve.services.kvstore.master_service import start_master
from pdserve.services.kvstore.node import start_node

MiB = 1 << 20
FP = "cd" * 32
LAYERS, BLOCKS, BS, K, D = 2, 8, 4, 3, 16
LAYOUTS = {1: (3,), 2: (2, 1), 3: (1, 1, 1)}
KEYS = [bytes([i]) * 32 for i in range(1, 5)]


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


class Engine:
    """The ranks of a TP=tp engine: each its own I/O thread and store client."""

    def __init__(self, tp, maddr, block_secret, fill=None):
        settings = KVStoreSettings(master_addr=maddr, role="both", transport="tcp",
                                   lookup_timeout_s=5.0, block_secret_file=block_secret)
        self.ios, self.clients, self.ranks = [], [], []
        offset = 0
        for rank, h in enumerate(LAYOUTS[tp]):
            io = IOThread(f"rank{rank}")
            # what a worker process would get: the settings pickled, no secret in them
            sent = pickle.dumps(settings)
            assert b"ef" * 32 not in sent
            client = io.run(pickle.loads(sent).open_client(), 30)
            codec = BlockCodec(FP, LAYERS, BS, K, D, mac_key=client.mac_key)
            caches = [torch.randn(2, BLOCKS, BS, h, D) if fill is None else torch.zeros(
                2, BLOCKS, BS, h, D) for _ in range(LAYERS)]
            self.ios.append(io)
            self.clients.append(client)
            self.ranks.append(RankTransfers(RankHeads(HeadObjects(codec), caches, offset),
                                            client, io, rank, lease_s=30.0,
                                            load_timeout_s=10.0))
            offset += h

    def run(self, t: Transfer) -> int:
        tally = Completions(len(self.ranks))
        tally.expect(t)
        for r in self.ranks:
            r.start(t)
        deadline, result = time.monotonic() + 30, None
        while tally.open:
            assert time.monotonic() < deadline, "a rank never reported"
            for r in self.ranks:
                for rep in r.poll():
                    result = tally.add(rep)
            time.sleep(0.01)
        assert all(r.in_flight == 0 for r in self.ranks)
        return result

    def block(self, block_id):
        return torch.stack([torch.cat([r.heads.caches[l][:, block_id] for r in self.ranks],
                                      dim=-2) for l in range(LAYERS)])

    def close(self):
        for io, c in zip(self.ios, self.clients):
            io.run(c.close(), 10)
            io.close()


def transfer(kind, ids):
    return Transfer("req", kind, tuple(BlockRef(k, b) for k, b in zip(KEYS, ids)))


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2), (3, 1)])
def test_a_block_each_rank_saved_its_heads_of_is_read_by_another_layout(cluster, writer,
                                                                         reader):
    maddr, secret = cluster
    src, dst = Engine(writer, maddr, secret), Engine(reader, maddr, secret, fill=0)
    try:
        assert src.run(transfer("save", [0, 1, 2, 3])) == 4
        assert src.run(transfer("save", [0, 1, 2, 3])) == 4  # again: stored (EXISTS) is fine

        async def lookup():
            return await dst.clients[0].prefix_lookup(list(KEYS))

        # the block keys (each last head's object) are what the router and connector look up
        assert dst.ios[0].run(lookup(), 10) == 4
        assert dst.run(transfer("load", [4, 5, 6, 7])) == 4
        for i in range(4):
            assert torch.equal(dst.block(4 + i), src.block(i))
        assert not any(r.heads.caches[0][:, :4].any() for r in dst.ranks)
    finally:
        src.close()
        dst.close()


def test_a_block_not_stored_loads_nothing_on_any_rank(cluster):
    maddr, secret = cluster
    src, dst = Engine(1, maddr, secret), Engine(2, maddr, secret, fill=0)
    try:
        assert src.run(transfer("save", [0, 1])) == 2  # blocks 0 and 1 only
        assert dst.run(transfer("load", [4, 5, 6])) == 2  # the third is a miss everywhere
        assert not any(r.heads.caches[0][:, 6].any() for r in dst.ranks)
    finally:
        src.close()
        dst.close()
