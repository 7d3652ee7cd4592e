"""Per-rank transfers over the real KV store (an in-process master on Redis and two storage
nodes, store and block secrets on): each tensor-parallel rank has its own store client and I/O
thread, opened from the same pickled `KVStoreSettings` (paths, no secret: each rank reads the
block secret from its file, as a worker process would), and puts / gets only its own heads'
objects; a block one layout wrote is a store hit for another layout, read back exactly."""

import pickle
import random
import time

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig
from pdserve.common.distributed.executor import WorkerGroup
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.kv_rank_messages import BlockRef, Transfer, TransferReport
from pdserve.common.engine.rank_kv_tally import Completions
from pdserve.common.models.registry import load_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.connector.codec import BlockCodec
from pdserve.connector.head_objects import HeadObjects, RankHeads
from pdserve.connector.io_thread import IOThread
from pdserve.connector.rank_kv_factory import RankTransfersFactory
from pdserve.connector.rank_transfers import RankTransfers
from pdserve.services.engine_host.kv_connector_factory import KVStoreSettings
from pdserve.tests.integration.rank_kv_cluster import cluster  # noqa: F401 - a fixture

FP = "cd" * 32
LAYERS, BLOCKS, BS, K, D = 2, 8, 4, 3, 16
LAYOUTS = {1: (3,), 2: (2, 1), 3: (1, 1, 1)}
KEYS = [bytes([i]) * 32 for i in range(1, 5)]


class Engine:
    """The ranks of an engine whose ranks hold `heads` KV heads each (in order): each rank
    its own I/O thread and store client."""

    def __init__(self, heads, maddr, block_secret, fill=None, layers=LAYERS, head_dim=D):
        self.ios, self.clients, self.ranks, self.layers = [], [], [], layers
        offset = 0
        for rank, h in enumerate(heads):
            io = IOThread(f"rank{rank}")
            # what a worker process would get: the settings pickled, no secret in them
            sent = pickle.dumps(settings(maddr, block_secret))
            assert b"ef" * 32 not in sent
            client = io.run(pickle.loads(sent).open_client(), 30)
            codec = BlockCodec(FP, layers, BS, sum(heads), head_dim, mac_key=client.mac_key)
            caches = [torch.randn(2, BLOCKS, BS, h, head_dim) if fill is None else
                      torch.zeros(2, BLOCKS, BS, h, head_dim) for _ in range(layers)]
            self.ios.append(io)
            self.clients.append(client)
            self.ranks.append(RankTransfers(RankHeads(HeadObjects(codec), caches, offset),
                                            client, io, rank, lease_s=30.0,
                                            load_timeout_s=10.0))
            offset += h
        self.reports = []

    def run(self, t: Transfer) -> int:
        tally = Completions(len(self.ranks))
        tally.expect(t)
        for r in self.ranks:
            r.start(t)
        deadline, result, self.reports = time.monotonic() + 30, None, []
        while tally.open:
            assert time.monotonic() < deadline, "a rank never reported"
            for r in self.ranks:
                for rep in r.poll():
                    self.reports.append(rep)
                    result = tally.add(rep)
            time.sleep(0.01)
        assert all(r.in_flight == 0 for r in self.ranks)
        return result

    def block(self, block_id, heads=slice(None)):
        return torch.stack([torch.cat([r.heads.caches[l][:, block_id] for r in self.ranks],
                                      dim=-2)[..., heads, :] for l in range(self.layers)])

    def close(self):
        for io, c in zip(self.ios, self.clients):
            io.run(c.close(), 10)
            io.close()


def settings(maddr, block_secret):
    return KVStoreSettings(master_addr=maddr, role="both", transport="tcp",
                           lookup_timeout_s=5.0, block_secret_file=block_secret)


def transfer(kind, ids, keys=KEYS):
    return Transfer("req", kind, tuple(BlockRef(k, b) for k, b in zip(keys, ids)))


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2), (3, 1)])
def test_a_block_each_rank_saved_its_heads_of_is_read_by_another_layout(cluster, writer,
                                                                         reader):
    maddr, secret = cluster
    src = Engine(LAYOUTS[writer], maddr, secret)
    dst = Engine(LAYOUTS[reader], maddr, secret, fill=0)
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
    src, dst = Engine(LAYOUTS[1], maddr, secret), Engine(LAYOUTS[2], maddr, secret, fill=0)
    try:
        assert src.run(transfer("save", [0, 1])) == 2  # blocks 0 and 1 only
        assert dst.run(transfer("load", [4, 5, 6])) == 2  # the third is a miss everywhere
        assert not any(r.heads.caches[0][:, 6].any() for r in dst.ranks)
    finally:
        src.close()
        dst.close()


def test_a_worker_process_moves_its_own_heads_and_only_those(cluster):
    """A TP=2 engine's worker (rank 1, a real process with the tiny model's caches) gets
    transfers with no step, loads its head of blocks a TP=1 engine saved and saves them again
    under new keys, reporting each to rank 0 over its socket; those new keys then hold its
    head's objects and no other head's."""
    maddr, secret = cluster
    tiny = load_model("tiny")
    c = tiny.config  # 2 layers, 2 KV heads: the worker holds head 1
    src = Engine((2,), maddr, secret, layers=c.num_layers, head_dim=c.head_dim)
    dst = Engine((1, 1), maddr, secret, fill=0, layers=c.num_layers, head_dim=c.head_dim)
    config = EngineConfig(model="tiny", num_threads=1,
                          cache=CacheConfig(num_blocks=BLOCKS, block_size=BS),
                          parallel=ParallelConfig(tensor_parallel_size=2, all_reduce="gloo"))
    factory = RankTransfersFactory(settings(maddr, secret),
                                   BlockCodec(FP, c.num_layers, BS, c.num_kv_heads, c.head_dim))
    group = WorkerGroup(config, BLOCKS, 1 << 12, (c, tiny.weights), rank_kv=factory)
    again = [bytes([0x40 + i]) * 32 for i in range(3)]
    try:
        group.wait_ready()
        assert src.run(transfer("save", [0, 1, 2])) == 3
        for t, want in ((transfer("load", [3, 4, 5]), 3),
                        (transfer("save", [3, 4, 5], again), 3)):
            group.send_transfers((t,))
            deadline, got = time.monotonic() + 30, []
            while not got:
                assert time.monotonic() < deadline, "the worker never reported"
                got = group.poll_reports()
                time.sleep(0.01)
            assert got == [TransferReport("req", t.kind, 1, want)]
        assert dst.run(transfer("load", [0, 1, 2], again)) == 0  # head 0: nobody saved it
        assert {r.rank: r.blocks for r in dst.reports} == {0: 0, 1: 3}
        for i in range(3):  # head 1 went store -> worker cache -> store -> here unchanged
            assert torch.equal(dst.block(i, slice(1, 2)), src.block(i, slice(1, 2)))
    finally:
        group.close()
        src.close()
        dst.close()


def _engine(tp, factory):
    return EngineCore(EngineConfig(model="tiny", num_threads=1,
                                   cache=CacheConfig(num_blocks=BLOCKS, block_size=BS),
                                   parallel=ParallelConfig(tensor_parallel_size=tp,
                                                           all_reduce="gloo")),
                      rank_kv=lambda _: factory)


def _finish(engine):
    """Wait until every rank reported every transfer the engine started (its link's tally):
    {(kind, seq): blocks every rank moved}."""
    done, deadline = {}, time.monotonic() + 30
    while engine.rank_kv.open:
        assert time.monotonic() < deadline, "a rank never reported"
        for f in engine.rank_kv.poll():
            done[(f.transfer.kind, f.transfer.seq)] = f.blocks
        time.sleep(0.01)
    return done


def _factory(cluster):
    c = load_model("tiny").config
    return RankTransfersFactory(settings(*cluster),
                                BlockCodec(FP, c.num_layers, BS, c.num_kv_heads, c.head_dim))


def _block(engine, block_id):
    return torch.stack([c[:, block_id] for c in engine.executor.runner.kv_caches])


def test_engines_of_two_layouts_move_kv_through_their_rank_links(cluster):
    """EngineCore given a RankKVFactory: its workers got it at spawn and rank 0 built its
    own. A TP=1 engine saves three blocks (its two heads), a TP=2 engine loads them (each rank
    its head, rank 0's one and the worker's one, started with no step) and saves them again
    under new keys, and the TP=1 engine loads those back exactly."""
    factory = _factory(cluster)
    one, two = _engine(1, factory), _engine(2, factory)
    again = [bytes([0x40 + i]) * 32 for i in range(3)]
    try:
        assert two.executor.runner.kv_caches[0].shape[3] == 1  # rank 0 holds head 0 only
        for cache in one.executor.runner.kv_caches:
            cache.copy_(torch.randn_like(cache))
        steps = [(one, transfer("save", [0, 1, 2])), (two, transfer("load", [3, 4, 5])),
                 (two, transfer("save", [3, 4, 5], again)),
                 (one, transfer("load", [5, 6, 7], again))]
        for engine, t in steps:
            engine.rank_kv.send((t,))
            assert _finish(engine) == {(t.kind, 0): 3}
        for i in range(3):
            assert torch.equal(_block(one, 5 + i), _block(one, i))
            assert torch.equal(_block(two, 3 + i), _block(one, i)[..., :1, :])
    finally:
        one.close()
        two.close()


def test_a_tp2_step_saves_what_its_forward_wrote_on_every_rank(cluster):
    """A save sent as the connector's per-rank mode sends it, right after rank 0's forward of
    the step that wrote the blocks: each worker reads it after its own forward of that step
    (socket order), so the stored heads are the KV that forward wrote; a TP=1 engine loads
    them and finds the KV it computes itself for the same prompt (up to the all-reduce's
    rounding)."""
    factory = _factory(cluster)
    one, two = _engine(1, factory), _engine(2, factory)
    prompt = random.Random(5).choices(range(one.model_config.vocab_size), k=3 * BS + 1)
    keys = [bytes([0x60 + i]) * 32 for i in range(3)]
    tables = {}

    def run(engine, save):
        execute = engine._execute

        def then_save(sched):  # as RankKVConnector.end_step does, after the forward
            logits = execute(sched)
            if sched.chunks and engine not in tables:
                tables[engine] = sched.chunks[0].block_ids
                if save:
                    engine.rank_kv.send((transfer("save", tables[engine][:3], keys),))
            return logits
        engine._execute = then_save
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()

    try:
        run(two, True)  # the reports wait in the link until polled
        assert _finish(two) == {("save", 0): 3}
        run(one, False)
        free = [b for b in range(BLOCKS) if b not in tables[one]][:3]
        load = transfer("load", free, keys)
        one.rank_kv.send((load,))
        assert _finish(one) == {("load", 0): 3}
        for got, want in zip(free, tables[one][:3]):
            assert torch.allclose(_block(one, got), _block(one, want), atol=1e-5)
    finally:
        one.close()
        two.close()
