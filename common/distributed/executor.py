"""Executors: run one scheduler step on every rank of the engine's model.

`Executor` is what EngineCore calls. `UniProcExecutor` runs the whole model in the engine
process. `MultiProcExecutor` (tensor parallel) runs rank 0 in the engine process and T-1 worker
processes (worker.py) beside it. `PipelineExecutor` (pipeline_executor.py) runs P stages of T
ranks each, with up to P steps in flight.

MultiProcExecutor lifecycle:
1. `start_workers` spawns the workers, hosts the torch.distributed store, joins the group
   (gloo on the CPU, NCCL on CUDA) and sets up the shared-memory all-reduce;
2. the engine builds rank 0's shard with the returned communicator, then `wait_ready` waits
   until every worker loaded its shard (a worker's error is raised here, with its message);
3. each `execute_model` sends the pickled SchedulerOutput to every worker, then runs rank 0's
   forward; the collectives inside keep the ranks in step;
4. `close` tells the workers to stop, waits briefly, and kills what is left.
A worker that dies makes the next (or the current) step raise WorkerDiedError; the executor
then aborts the shared-memory barrier and kills the other workers, so no process is left
behind and nothing hangs. There is no recovery: the engine is dead (its service reports
unhealthy, and a supervisor restarts it).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
from typing import TYPE_CHECKING, Optional, Protocol

import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

import torch

from pdserve.common.config import EngineConfig, ModelConfig
from pdserve.common.distributed.worker import WorkerSpec
from pdserve.common.engine.model_runner import LayerDone, ModelRunner
from pdserve.common.engine.protocol import EngineFatalError
from pdserve.common.engine.kv_rank_messages import Transfer, TransferReport
from pdserve.common.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.common.distributed.rank_kv import RankKVFactory

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading SmolLM2 in T processes on 2 shared cores can be slow
_STOP_WAIT_S = 5.0
_DEATH_GRACE_S = 1.0  # after a failed step: time for a dying worker to show as dead
_WATCH_S = 0.05  # how often the pipeline's watch thread looks at the workers


class WorkerDiedError(EngineFatalError):
    """A tensor- or pipeline-parallel worker died or failed; the engine cannot go on."""


class Executor(Protocol):
    runner: ModelRunner  # rank 0's
    depth: int  # steps that may be in flight at once (submit before collect); 1: one at a time
    # the KV connector's view: per tensor rank, its caches of every layer (all pipeline
    # stages joined); T x P > 1: only when they were put in shared memory for a connector
    # (kv_share.py), else rank 0's alone
    kv_shards: list[list[torch.Tensor]]

    def execute_model(self, out: SchedulerOutput, layer_done: Optional[LayerDone] = None
                      ) -> torch.Tensor:
        """Run a non-empty step on every rank; logits [N, V] of the sampled chunks."""

    def submit(self, out: SchedulerOutput) -> None:
        """Start a non-empty step; at most `depth` may be started and not collected."""

    def collect(self) -> torch.Tensor:
        """Logits [N, V] of the oldest started step's sampled chunks (waits for them)."""

    def check_health(self) -> None:
        """Raise WorkerDiedError when a rank is gone."""

    def send_transfers(self, transfers: tuple[Transfer, ...]) -> None:
        """Per-rank KV transfers the workers start now, with no step (rank 0 starts its own:
        rank_kv_link.py); nothing to send without workers."""

    def poll_reports(self) -> list[TransferReport]:
        """The workers' per-rank KV transfer reports that arrived, without waiting."""

    def close(self) -> None:
        """Stop every rank; idempotent."""


class _OneAtATime:
    """submit / collect for executors that run a step in one call (depth 1)."""

    depth = 1
    _started: Optional[SchedulerOutput] = None

    def submit(self, out: SchedulerOutput) -> None:
        if self._started is not None:
            raise RuntimeError("a step is already started: collect it first")
        self._started = out

    def collect(self) -> torch.Tensor:
        out, self._started = self._started, None
        if out is None:
            raise RuntimeError("no step started")
        return self.execute_model(out)


class UniProcExecutor(_OneAtATime):
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv_shards = [runner.kv_caches]

    def execute_model(self, out, layer_done=None) -> torch.Tensor:
        return self.runner.execute(out, layer_done)

    def check_health(self) -> None:
        pass

    def send_transfers(self, transfers: tuple[Transfer, ...]) -> None:
        pass  # rank 0 is the only rank

    def poll_reports(self) -> list[TransferReport]:
        return []

    def close(self) -> None:
        pass


class WorkerGroup:
    """The T*P-1 worker processes and rank 0's end of the group (stage 1 of the lifecycle).

    Workers are fresh interpreters (`python -m pdserve.common.distributed.worker FD`), not
    multiprocessing children: spawn would re-run the caller's __main__ (a console script has no
    guard), and fork is unsafe in a process with gRPC and OpenMP threads. Each gets one end of
    a socketpair; its WorkerSpec goes over it first, then the steps.

    With pipeline stages (P > 1) a watch thread kills every worker as soon as one dies: a
    rank of a later stage can be blocked on a peer that rank 0 has no collective with (a
    stage's shared-memory barrier, a hand-off), and the kill makes rank 0's own wait (a
    receive from the last stage) fail instead of running into the collective timeout."""

    def __init__(self, config: EngineConfig, num_blocks: int, slot_floats: int,
                 model: Optional[tuple[ModelConfig, dict]] = None,
                 shared_kv: Optional[ModelConfig] = None,
                 rank_kv: Optional["RankKVFactory"] = None):
        """`shared_kv`: the model's config when every rank's KV cache must live in shared
        memory (a KV connector; kv_share.py); `kv_paths` then names the files, rank order.
        `rank_kv`: each worker moves its own heads' KV (rank_kv.py; `send_transfers`,
        `poll_reports`)."""
        from pdserve.common.distributed.kv_share import create_kv_files
        from pdserve.common.distributed.shm_comm import ShmCommunicator, make_buffers
        from pdserve.common.distributed.torch_comm import init_group, make_store

        self.comm = None
        self._stop_watch = threading.Event()
        par = config.parallel
        tp, world = par.tensor_parallel_size, par.world_size
        self.kv_paths: list[str] = []
        if shared_kv is not None:  # one file per global rank (kv_share.py)
            self.kv_paths = create_kv_files(shared_kv, tp, par.pipeline_parallel_size,
                                            num_blocks, config.cache.block_size)
        self._store = make_store(0, world, is_master=True)
        use_shm = par.all_reduce != "gloo" and config.device == "cpu" and tp > 1
        # one set of all-reduce buffers per stage's tensor-parallel group
        self._shm = [make_buffers(tp, slot_floats) for _ in range(par.pipeline_parallel_size)
                     ] if use_shm else []
        self._shm_paths = [b.path for b in self._shm]
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns,
                                           list(self._shm_paths), list(self.kv_paths))
        try:
            for rank in range(1, world):
                spec = WorkerSpec(rank, world, self._store.port, config, num_blocks, model,
                                  self._shm_paths[rank // tp] if self._shm else None,
                                  slot_floats, self.kv_paths[rank] if self.kv_paths else None,
                                  rank_kv)
                self._spawn(spec)
            self._expect("hello")
            comm = init_group(self._store, 0, world, config.device, tp)
            if self._shm:
                comm = ShmCommunicator(0, tp, self._shm[0].ctrl, self._shm[0].data,
                                       self.alive, comm)
        except BaseException:
            self.close()
            raise
        self.comm = comm
        if par.pipeline_parallel_size > 1:
            threading.Thread(target=self._watch, daemon=True,
                             name="pdserve-worker-watch").start()

    def _watch(self) -> None:
        while not self._stop_watch.wait(_WATCH_S):
            if not self.alive():
                for buf in self._shm:
                    buf.abort()
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                return

    def _spawn(self, spec: WorkerSpec) -> None:
        mine, theirs = socket.socketpair()
        try:
            p = subprocess.Popen([sys.executable, "-m", "pdserve.common.distributed.worker",
                                  str(theirs.fileno())], pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        self.procs.append(p)
        self.conns.append(conn)
        conn.send_bytes(pickle.dumps(spec))  # plain pickle: tensors by value, no fd sharing

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def any_died_within(self, seconds: float) -> bool:
        """Whether a worker is dead or dies within `seconds` (a peer's socket closes a moment
        before the process is reapable)."""
        deadline = time.monotonic() + seconds
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _expect(self, what: str) -> None:
        """Wait for `what` from every worker; a worker's error or death raises."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.1):
                if p.poll() is not None:
                    raise WorkerDiedError(f"tensor-parallel worker {rank} exited with code "
                                          f"{p.returncode} while starting")
                if time.monotonic() > deadline:
                    raise WorkerDiedError(f"tensor-parallel worker {rank} did not start in "
                                          f"{STARTUP_TIMEOUT_S:.0f} s")
            try:
                msg = conn.recv()
            except EOFError:
                p.wait(_STOP_WAIT_S)
                raise WorkerDiedError(f"tensor-parallel worker {rank} exited with code "
                                      f"{p.returncode} while starting") from None
            if msg[0] == "error":
                raise WorkerDiedError(f"tensor-parallel worker {rank} failed: {msg[1]}")
            if msg[0] != what:
                raise WorkerDiedError(f"tensor-parallel worker {rank} sent {msg[0]!r}, "
                                      f"expected {what!r}")

    def send_transfers(self, transfers: tuple[Transfer, ...]) -> None:
        """Per-rank KV transfers to start now, with no step (a load that starts while no
        request runs); a step's own go in its SchedulerOutput."""
        payload = pickle.dumps(SchedulerOutput(transfers=transfers),
                               protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def poll_reports(self) -> list[TransferReport]:
        """The workers' per-rank KV transfer reports that arrived, without waiting. A
        worker's error message raises WorkerDiedError; anything else it sends is refused the
        same way (Completions checks the reports themselves)."""
        out = []
        for rank, conn in enumerate(self.conns, start=1):
            while conn.poll(0):
                try:
                    msg = conn.recv()
                except EOFError:
                    raise WorkerDiedError(f"worker {rank} closed its socket") from None
                if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "kv"
                        and isinstance(msg[1], TransferReport)):
                    raise WorkerDiedError(f"worker {rank} sent {str(msg)[:200]}")
                out.append(msg[1])
        return out

    def wait_ready(self) -> None:
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise
        for path in self._shm_paths:  # every rank mapped them: the names are no longer needed
            os.unlink(path)
        self._shm_paths = []
        from pdserve.common.distributed.kv_share import unlink_kv_files
        unlink_kv_files(self.kv_paths)  # rank 0 mapped them all before this

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            self._stop_watch.set()
            comm.abort()  # a worker stuck in a barrier raises instead of spinning on
            for buf in self._shm:  # (the other stages' groups too)
                buf.abort()
        self._finalizer()
        if comm is not None:
            comm.close()


def _shutdown(procs, conns, shm_paths, kv_paths) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    deadline = time.monotonic() + _STOP_WAIT_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(_STOP_WAIT_S)
    for conn in conns:
        conn.close()
    for path in shm_paths + kv_paths:
        if os.path.exists(path):
            os.unlink(path)


class MultiProcExecutor(_OneAtATime):
    def __init__(self, runner: ModelRunner, workers: WorkerGroup,
                 kv_shards: Optional[list[list[torch.Tensor]]] = None):
        self.runner, self.workers = runner, workers
        self.kv_shards = kv_shards or [runner.kv_caches]
        self._closed = False

    def execute_model(self, out, layer_done=None) -> torch.Tensor:
        self.check_health()
        try:
            self._send_step(out)
            logits = self.runner.execute(out, layer_done)
        except Exception as exc:
            self._failed(exc)
        return logits

    def _send_step(self, out: SchedulerOutput) -> None:
        payload = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.workers.conns:
            conn.send_bytes(payload)

    def _failed(self, exc: Exception):
        """A step failed on rank 0: stop everything and raise (WorkerDiedError when a worker
        died: then that is the cause)."""
        # the ranks may now be at different collectives: no later step could pair them up
        died = self.workers.any_died_within(_DEATH_GRACE_S)
        self._fail()
        if died:
            raise WorkerDiedError(f"a worker died during a step: {exc}") from exc
        raise exc

    def check_health(self) -> None:
        if self._closed:
            raise WorkerDiedError("the workers are stopped")
        if not self.workers.alive():
            self._fail()
            dead = [f"{r} (exit code {p.returncode})"
                    for r, p in enumerate(self.workers.procs, start=1) if p.poll() is not None]
            raise WorkerDiedError(f"worker(s) {', '.join(dead)} died")

    def send_transfers(self, transfers: tuple[Transfer, ...]) -> None:
        self.check_health()
        try:
            self.workers.send_transfers(transfers)
        except Exception as exc:
            self._failed(exc)

    def poll_reports(self) -> list[TransferReport]:
        self.check_health()
        try:
            return self.workers.poll_reports()
        except Exception as exc:
            self._failed(exc)

    def _fail(self) -> None:
        log.error("a parallel step failed; stopping the workers (engine pid %d)",
                  os.getpid())
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.workers.close()
