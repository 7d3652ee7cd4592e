"""RankKVConnector's bookkeeping over a fake RankKVLink (connector/rank_connector.py): which
Transfers it sends and when, and how every rank's finished transfers become saved / loaded /
failed, holds and save budget. Real ranks and store: tests/integration/test_rank_kv_disagg.py."""

from types import SimpleNamespace

from pdserve.common.engine.rank_kv_link import Finished
from pdserve.connector.codec import BlockCodec
from pdserve.connector.rank_connector import RankKVConnector
from pdserve.connector.store import InMemoryBlockStore
from pdserve.connector.store_connector import ConnectorConfig

BS = 4
KEYS = [bytes([i]) * 32 for i in range(1, 5)]
CODEC = BlockCodec("ab" * 32, 2, BS, 2, 8)


class FakeLink:
    def __init__(self):
        self.sent, self.done = [], []

    def send(self, transfers):
        self.sent.extend(transfers)

    def poll(self):
        out, self.done = self.done, []
        return out


def _connector(role="producer", **kw):
    link = FakeLink()
    c = RankKVConnector(InMemoryBlockStore(), CODEC,
                        ConnectorConfig(role=role, per_rank=True, **kw), link)
    return c, link


def _request(rid="r", computed=0):
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed, block_hashes=KEYS,
                           kv_transfer=SimpleNamespace(store_output=True))


def test_a_steps_full_blocks_go_to_every_rank_after_the_step_and_hold_until_saved():
    c, link = _connector()
    req = _request()
    c.begin_step([(req, 2 * BS + 1, [7, 8, 9])])
    assert link.sent == []  # nothing before the forward
    c.end_step()
    (t,) = link.sent
    assert t.kind == "save" and [(b.key, b.block_id) for b in t.blocks] == \
        [(KEYS[0], 7), (KEYS[1], 8)]
    assert c.request_finished(req, [7, 8, 9]) is True  # held while any rank still reads
    assert c.get_finished() == (set(), set())
    link.done = [Finished(t, 1)]  # one block stored on every rank: the save is over anyway
    assert c.get_finished() == ({"r"}, set())
    assert c.request_finished(req, [7, 8, 9]) is False
    assert c.stats.blocks_saved == 1 and c.stats.save_failures == 1


def test_a_load_is_sent_at_once_and_fails_at_the_fewest_blocks_any_rank_moved():
    c, link = _connector("consumer")
    c.update_state_after_alloc(_request(), [3, 4, 5], 0, 3 * BS)
    (t,) = link.sent
    assert t.kind == "load" and [b.block_id for b in t.blocks] == [3, 4, 5]
    link.done = [Finished(t, 1)]
    assert c.get_finished() == (set(), set())
    assert c.get_failed_loads() == {"r": BS}
    assert c.stats.blocks_loaded == 1 and c.stats.load_failures == 1
    c.update_state_after_alloc(_request("s"), [3, 4, 5], 0, 3 * BS)
    link.done = [Finished(link.sent[-1], 3)]
    assert c.get_finished() == (set(), {"s"}) and c.get_failed_loads() == {}


def test_decodes_saves_take_from_the_budget_until_every_rank_is_done():
    c, link = _connector("consumer", save_budget_bytes=CODEC.nbytes)  # one block
    c.begin_step([(_request(), 2 * BS, [7, 8])])
    c.end_step()
    (t,) = link.sent
    assert len(t.blocks) == 1 and c.stats.saves_over_budget == 1
    c.begin_step([(_request("s"), BS, [9])])  # the budget is spent: nothing saved
    c.end_step()
    assert len(link.sent) == 1
    link.done = [Finished(t, 1)]
    c.get_finished()
    c.begin_step([(_request("s"), BS, [9])])  # given back
    c.end_step()
    assert len(link.sent) == 2 and link.sent[1].seq != t.seq
