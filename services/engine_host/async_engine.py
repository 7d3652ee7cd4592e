"""AsyncEngine: drives one EngineCore on its own thread and streams its outputs to asyncio.

Lifecycle: construct with a built EngineCore (loading a model is slow and happens before the
service reports healthy), `start(loop)` spawns the engine thread, `submit()` hands requests to
it, `stop()` fails every open stream and joins the thread. EngineCore is not thread-safe, so
the engine thread is the only one that touches it: the event loop sends commands through a
thread-safe queue, and the engine thread sends outputs back with `call_soon_threadsafe`, one
callback per step. The engine thread never waits on a reader (RequestStream coalesces instead).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pdserve.common.engine.kv_transfer import KVTransferParams
from pdserve.common.engine.protocol import EngineFatalError
from pdserve.common.engine.outputs import EngineStats, FinishReason, RequestOutput
from pdserve.common.engine.protocol import EngineClient
from pdserve.common.engine.step_budget import StepBudgetController
from pdserve.common.sampling_params import SamplingParams
from pdserve.services.engine_host.request_stream import RequestStream
from pdserve.services.engine_host.request_timeline import TimelineTracker
from pdserve.services.engine_host.step_log import StepLog
from pdserve.services.registry.engine_snapshot import SUMMARY_PERIOD_S, cache_summary

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (the service is shutting down, or the loop itself broke)."""


class RequestFailedError(RuntimeError):
    """A step raised while this request was in the batch: the request is aborted, the engine
    goes on serving the others."""


@dataclass(frozen=True)
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: Optional[int] = None  # sampled by a prefill instance, already delivered
    kv_transfer: Optional[KVTransferParams] = None  # where a prefill instance stored the KV
    resumed_token_ids: tuple = ()  # generated and delivered before a migration


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class AsyncEngine:
    def __init__(self, core: EngineClient, max_pending_outputs: int = 8, idle_poll_s: float = 0.5,
                 step_budget: Optional[StepBudgetController] = None,
                 step_log: Optional[StepLog] = None,
                 after_warm_up: Optional[Callable[[], object]] = None):
        """`step_budget`: sets the scheduler's token budget before each step from measured
        step times (`--itl-target-ms`); None -> the configured budget, fixed. `step_log`:
        records every step (step_log.py, an experiment switch); None -> nothing recorded.
        `after_warm_up`: run on the engine thread once warm-up succeeded and before Health
        says SERVING (the service's entry point freezes its start-up heap there, so no
        request meets that collection); None -> nothing."""
        self.core = core
        self.profile = core.profile  # the core's step phases; the service adds its own
        self._budget = step_budget
        self._step_log = step_log
        self._after_warm_up = after_warm_up
        self._max_pending = max_pending_outputs
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._timelines = TimelineTracker(core)  # engine thread only
        self._stats: EngineStats = core.stats()  # replaced (never mutated) by the engine thread
        # The registry heartbeat's summary of the local prefix cache (engine_snapshot.py):
        # a tuple the engine thread replaces about once a second, never mutates.
        self.cached_block_hashes: tuple = ()
        self._summary_due = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._dead: Optional[BaseException] = None
        self.num_aborted = 0  # unfinished requests aborted by their readers (engine thread)
        self.num_finished = 0  # requests that ended by stop or length (engine thread)
        self.num_step_failures = 0  # steps that raised; their batches were aborted
        self._draining = False  # set once by begin_drain(): no new requests
        self.warmed_up = False  # the engine thread's core.warm_up() finished: SERVING from then
        self._warm_done = asyncio.Event()  # set on the loop once warm-up ended (or failed)
        self.busy = False  # requests or KV saves still open (engine thread writes)
        # CPU time of the engine thread inside its steps (ns): beside the steps' wall time it
        # says how long the thread waited (for the GIL, for torch's other threads, for a core)
        self.step_cpu_ns = 0

    # --- event loop side ---
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """Warmed up, running and taking requests (Health says NOT_SERVING while warming up
        and while draining)."""
        return (self.warmed_up and self._thread is not None and self._thread.is_alive()
                and self._dead is None and not self._draining)

    def begin_drain(self) -> None:
        """Refuse new requests (EngineDeadError -> UNAVAILABLE, which routers retry
        elsewhere); those already running go on to their end."""
        self._draining = True

    async def wait_warmed_up(self) -> bool:
        """Waits until the engine thread's warm-up ended; True when it succeeded."""
        await self._warm_done.wait()
        return self.warmed_up

    async def drained(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Waits until no request runs and no KV save is pending (True), or timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy and self._dead is None and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return not self.busy

    def stats(self) -> EngineStats:
        return self._stats

    def kv_stats(self):
        """The KV connector's transfer counters (ConnectorStats), None without a connector.
        Its counters are plain ints the I/O thread bumps; reading them here is safe."""
        return self.core.kv_transfer_stats()

    async def submit(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, first_token_id: Optional[int] = None,
                     kv_transfer: Optional[KVTransferParams] = None,
                     resumed_token_ids: tuple = ()) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. With
        `first_token_id` generation continues after that token (see EngineCore.add_request).

        Raises ValueError when the engine refuses the request (and nothing is left behind),
        EngineDeadError when the engine is gone. Callers must `close()` the stream.
        """
        if self._draining:
            raise EngineDeadError("draining: this instance is shutting down")
        if self._thread is not None and not self.warmed_up:
            await self._warm_done.wait()  # in process only: Health keeps routers away till then
        if not self.healthy:
            raise EngineDeadError("engine is not running" if self.warmed_up
                                  else "engine is warming up")
        stream = RequestStream(request_id, self._max_pending, self._abort)
        self._commands.put(_Add(stream, list(prompt_token_ids), params, first_token_id,
                                kv_transfer, tuple(resumed_token_ids)))
        try:
            await stream.wait_accepted()
        except BaseException:
            stream.close()  # cancelled while queued: the abort follows the add
            raise
        return stream

    def _abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # --- engine thread ---
    def _run(self) -> None:
        try:
            try:
                self.core.warm_up()  # before any command: Health is NOT_SERVING until then
                self._stats = self.core.stats()
                if self._after_warm_up is not None:
                    self._after_warm_up()
                self.warmed_up = True
            finally:
                self._loop.call_soon_threadsafe(self._warm_done.set)
            while True:
                busy = self.core.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if self.core.has_unfinished_requests():
                    self._step()
                else:
                    self._stats = self.core.stats()
                    if self._step_log is not None:
                        self._step_log.flush()  # idle: no step waits on the file
                self.busy = bool(self._streams) or self.core.has_unfinished_requests()
                if time.monotonic() >= self._summary_due:
                    self.cached_block_hashes = cache_summary(self.core)
                    self._summary_due = time.monotonic() + SUMMARY_PERIOD_S
        except BaseException as exc:  # a broken engine must not hang its clients
            log.exception("engine loop died")
            self._dead = exc
        if self._step_log is not None:
            self._step_log.flush()
        self._fail_all(self._dead or EngineDeadError("engine stopped"))

    def _step(self) -> None:
        """One engine step, timed, then its outputs handed to the event loop."""
        if self._budget is not None:
            self._set_budget()
        steps, fwd = self.profile.num_steps, self.profile.forward_ns
        tokens, sampled = self.profile.num_tokens, self.profile.num_sampled
        log_before = None if self._step_log is None else \
            self._step_log.before_step(self.core.running_requests())
        t0, c0 = time.time_ns(), time.thread_time_ns()
        try:
            outputs = self.core.step()
        except EngineFatalError:
            raise  # the engine cannot go on (a rank is gone): end the loop below
        except Exception as exc:  # one bad batch must not end the engine
            self._step_failed(exc)
            return
        t1 = time.time_ns()
        cpu = time.thread_time_ns() - c0
        self.step_cpu_ns += cpu
        if log_before is not None and self.profile.num_steps != steps:
            self._step_log.observe(
                t0, self.profile.num_tokens - tokens,
                self.profile.num_sampled - sampled, t1 - t0,
                self.profile.forward_ns - fwd, cpu, log_before, c0)
        if self._budget is not None and self.profile.num_steps != steps:
            self._budget.observe(self.profile.last_step_tokens, (t1 - t0) * 1e-9)
        self._timelines.observe(t0, t1)  # before publishing: see RequestTimeline
        # the snapshot first: a client that saw this step's outputs reads its stats
        self._stats = self.core.stats()
        self._publish(outputs, t1)
        self.profile.publish_ns += time.time_ns() - t1

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when told to stop."""
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block \
                else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            if self._streams.pop(cmd.request_id, None) is not None:
                self.num_aborted += 1
            self._timelines.forget(cmd.request_id)
            self.core.abort_request(cmd.request_id)
            return
        stream = cmd.stream
        rid = stream.request_id
        try:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already running")
            self.core.add_request(rid, cmd.prompt_token_ids, cmd.params,
                                  first_token_id=cmd.first_token_id,
                                  kv_transfer=cmd.kv_transfer,
                                  resumed_token_ids=cmd.resumed_token_ids)
        except ValueError as exc:
            self._loop.call_soon_threadsafe(stream.fail, exc)
            return
        except Exception as exc:  # a bug, not bad input: fail this request, never hang it
            log.exception("add_request failed for %s", rid)
            self._loop.call_soon_threadsafe(
                stream.fail, RequestFailedError(f"the engine could not take this request "
                                                f"({type(exc).__name__}: {exc})"))
            return
        self._streams[rid] = stream
        self.busy = True
        self._timelines.watch(rid, stream.timeline)
        self._loop.call_soon_threadsafe(stream.accept)

    def _set_budget(self) -> None:
        has_decodes = any(r.num_tokens - r.num_computed_tokens == 1
                          for r in self.core.running_requests())
        self.core.set_token_budget(self._budget.budget(has_decodes))

    def _step_failed(self, exc: Exception) -> None:
        """Aborts the requests that were running when the step raised (the batch), each
        failing with a clear error; waiting requests and the loop go on. An abort that raises
        too means the core is broken: that ends the loop (see `_run`)."""
        log.error("engine step failed; aborting the batch", exc_info=exc)
        self.num_step_failures += 1
        err = RequestFailedError(f"the engine failed while computing this request "
                                 f"({type(exc).__name__}: {exc}); it was aborted")
        for rid in [r.request_id for r in self.core.running_requests()]:
            self.core.abort_request(rid)
            self._timelines.forget(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._loop.call_soon_threadsafe(stream.fail, err)

    def _publish(self, outputs: list[RequestOutput], now_ns: int) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its reader; nobody listens
            if out.finished:
                del self._streams[out.request_id]
                self._timelines.forget(out.request_id)
                stream.timeline.finished_ns = now_ns
                self.num_finished += out.finish_reason != FinishReason.ABORT
            batch.append((stream, out))
        if batch:
            self._loop.call_soon_threadsafe(_deliver, batch, self.profile, time.time_ns())

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        while True:  # requests queued but never taken fail too
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                streams.append(cmd.stream)
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
        for stream in streams:
            try:
                self._loop.call_soon_threadsafe(stream.fail, err)
            except RuntimeError:
                pass  # the loop is already closed


def _deliver(batch: list[tuple[RequestStream, RequestOutput]], profile, sent_ns: int) -> None:
    t0 = time.time_ns()
    for stream, out in batch:
        stream.put(out)
    profile.handoff_ns += t0 - sent_ns  # written on the loop thread only
    profile.deliver_ns += time.time_ns() - t0
