"""RankKVLink, rank 0's end of per-rank KV transfers (common/engine/rank_kv_link.py), over a
fake executor and a fake rank 0 RankKV: who starts what, in which order, and where the
reports come from. The real store and worker processes: tests/integration/
test_rank_transfers_store.py."""

import pytest

from pdserve.common.config import EngineConfig, ParallelConfig
from pdserve.common.distributed.executor import WorkerDiedError
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.kv_rank_messages import BlockRef, Transfer, TransferReport
from pdserve.common.engine.rank_kv_link import Finished, RankKVLink
from pdserve.common.engine.scheduler_output import ScheduledChunk, SchedulerOutput


class FakeExecutor:
    def __init__(self, log):
        self.log, self.reports = log, []

    def send_transfers(self, transfers):
        self.log.append(("workers", transfers))

    def poll_reports(self):
        out, self.reports = self.reports, []
        return out


class FakeRankKV:
    def __init__(self, log):
        self.log, self.closed = log, 0

    def start(self, t):
        self.log.append(("rank0", t))

    def close(self):
        self.closed += 1


def _transfer(kind, seq=0):
    return Transfer("r", kind, (BlockRef(b"k" * 32, 1),), seq)


def _link(log, world=2):
    link = RankKVLink(FakeExecutor(log), world)
    link.attach(FakeRankKV(log))
    return link


def test_send_orders_the_workers_first_then_starts_rank_0s_part():
    log = []
    link = _link(log)
    ts = (_transfer("save"), _transfer("load"))
    link.send(ts)
    assert log == [("workers", ts), ("rank0", ts[0]), ("rank0", ts[1])]
    link.send(())  # nothing to send: the workers get no empty message
    assert len(log) == 3 and link.open == 2


def test_transfers_travel_in_a_message_of_their_own():
    chunk = ScheduledChunk("r", (1, 2), 0, (0,), True)
    with pytest.raises(ValueError, match="message of their own"):
        SchedulerOutput(chunks=(chunk,), transfers=(_transfer("save"),))
    assert SchedulerOutput(transfers=(_transfer("save"),)).num_tokens == 0


def test_a_transfer_is_finished_when_every_rank_reported_it_with_the_fewest_blocks():
    log = []
    link = _link(log)
    ex = link.executor
    t = Transfer("r", "load", (BlockRef(b"k" * 32, 1), BlockRef(b"j" * 32, 2)))
    link.send((t,))
    link.on_report(TransferReport("r", "load", 0, 2))
    assert link.poll() == []  # rank 1 has not reported
    ex.reports = [TransferReport("r", "load", 1, 1)]
    assert link.poll() == [Finished(t, 1)]
    assert link.open == 0 and link.poll() == []


def test_a_bad_report_fails_the_engine_like_a_dead_worker():
    log = []
    link = _link(log)
    link.send((_transfer("save"),))
    link.executor.reports = [TransferReport("r", "save", 1, 2)]  # more blocks than ordered
    with pytest.raises(WorkerDiedError):
        link.poll()


def test_a_transfer_already_in_flight_is_refused_before_any_rank_starts():
    log = []
    link = _link(log)
    link.send((_transfer("save"),))
    with pytest.raises(ValueError):
        link.send((_transfer("save", 1), _transfer("save")))
    with pytest.raises(ValueError):
        link.send((_transfer("load"), _transfer("load")))
    assert len(log) == 2 and link.open == 1  # only the first send went anywhere


def test_no_rank_0_transfers_refuses_to_start_and_close_is_idempotent():
    log = []
    link = RankKVLink(FakeExecutor(log), 1)
    with pytest.raises(RuntimeError):
        link.send((_transfer("save"),))
    own = FakeRankKV(log)
    link.attach(own)
    link.close()
    link.close()
    assert own.closed == 1


def test_an_engine_with_pipeline_stages_refuses_per_rank_transfers_before_any_process():
    config = EngineConfig(model="tiny", num_threads=1,
                          parallel=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(NotImplementedError, match="pipeline"):
        EngineCore(config, rank_kv=lambda _: object())
