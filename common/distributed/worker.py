"""A tensor- or pipeline-parallel worker process (ranks 1..T*P-1; the engine process is rank 0).

Lifecycle, driven by rank 0 over a socket (`python -m pdserve.common.distributed.worker FD`):
1. receives its `WorkerSpec`; sends ("hello",), joins the torch.distributed group,
2. loads the model, keeps only its shard, allocates its part of the KV cache, and sends
   ("ready",) or ("error", message),
3. loops: receives a pickled SchedulerOutput and runs the forward (the collectives inside pair
   it with the other ranks); None, or the socket closing (rank 0 died), ends the loop. A
   pipeline stage after the first first receives the previous stage's hidden states, and
   hands its own on (pipeline.py); the last stage's tensor rank 0 sends rank 0 the logits.
   With `spec.rank_kv` a message with no chunks carries per-rank KV transfers instead: the
   rank starts them (after the forwards of the steps before it, in socket order) and sends
   ("kv", report) for each as it ends, from the transfers' I/O thread (rank_kv.py).
A failure in a collective (a peer died) ends the process with an error; nothing is retried.
A watchdog thread ends the process when rank 0 is gone (its parent changes), whatever the
main thread is blocked in.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pdserve.common.config import EngineConfig, ModelConfig
from pdserve.common.host_heap import apply_host_heap

if TYPE_CHECKING:
    from pdserve.common.distributed.rank_kv import RankKVFactory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int  # global: stage * T + tensor rank (layout.RankPlace)
    world_size: int  # T x P
    store_port: int
    config: EngineConfig
    num_blocks: int
    # the model to load when the engine was given one in memory (tests); None -> by name
    model: Optional[tuple[ModelConfig, dict]] = None
    shm_path: Optional[str] = None  # its stage's shared-memory all-reduce buffers (shm_comm)
    slot_floats: int = 0
    kv_path: Optional[str] = None  # this rank's KV cache file (kv_share.py), with a connector
    # builds this rank's own KV transfers (rank_kv.py); None: rank 0 moves every rank's KV
    rank_kv: Optional["RankKVFactory"] = None


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    conn = Connection(int(argv[0]))
    try:
        spec = pickle.loads(conn.recv_bytes())
    except EOFError:
        return 0
    worker_main(spec, conn, parent)
    return 0


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)  # rank 0 died: nobody will send another step


def worker_main(spec: WorkerSpec, conn, parent: int) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[rank {spec.rank}] %(message)s")
    comm = kv = None
    send_lock = threading.Lock()  # the main thread's messages and the KV reports'
    try:
        conn.send(("hello",))
        comm = _join(spec, parent)
        runner, link = _build(spec, comm)
        if spec.config.device == "cpu":  # after loading: the loader's frees went back
            apply_host_heap(spec.config.host_heap)
        kv = _build_rank_kv(spec, runner, conn, send_lock)
        conn.send(("ready",))
        _loop(conn, runner, link, kv)
    except (EOFError, BrokenPipeError):
        pass  # rank 0 went away: nothing left to serve
    except BaseException as exc:  # report what we can, then die: rank 0 takes the engine down
        try:
            with send_lock:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        log.exception("worker failed")
        sys.exit(1)
    finally:
        if kv is not None:
            kv.close()
        if comm is not None:
            comm.close()


def _join(spec: WorkerSpec, parent: int):
    from pdserve.common.distributed.shm_comm import ShmCommunicator, attach_buffers
    from pdserve.common.distributed.torch_comm import init_group, make_store

    cfg = spec.config
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    tp = cfg.parallel.tensor_parallel_size
    store = make_store(spec.store_port, spec.world_size, is_master=False)
    comm = init_group(store, spec.rank, spec.world_size, cfg.device, tp)
    if spec.shm_path is not None:
        shm = attach_buffers(spec.shm_path, tp, spec.slot_floats)
        comm = ShmCommunicator(comm.rank, tp, shm.ctrl, shm.data,
                               lambda: os.getppid() == parent, comm)
    return comm


def _build(spec: WorkerSpec, comm):
    from pdserve.common.distributed.layout import RankPlace, TensorParallel, pipeline_stage
    from pdserve.common.distributed.pipeline import StageLink
    from pdserve.common.distributed.pipeline_head import (LastStageHead, head_cut,
                                                          last_stage_inputs)
    from pdserve.common.models.dtype import resolve_dtype
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.engine.rank_model import (allocate_kv_caches, build_rank_model,
                                                  rank_device)
    from pdserve.common.kv.dtype import engine_kv_dtype
    from pdserve.common.models.registry import load_model

    cfg = spec.config
    if spec.model is not None:
        model_config, weights = spec.model
    else:
        loaded = load_model(cfg.model, tiny_seed=cfg.tiny_model_seed, weights=cfg.weights)
        model_config, weights = loaded.config, loaded.weights
    device = rank_device(cfg.device, spec.rank, spec.world_size)
    par = cfg.parallel
    place = RankPlace(spec.rank, par.tensor_parallel_size, par.pipeline_parallel_size)
    tp = TensorParallel(place.tp_rank, place.tp_size, comm if place.tp_size > 1 else None)
    pp = pipeline_stage(model_config.num_layers, place.stage, place.pp_size)
    cut = head_cut(cfg, model_config, device) if pp.is_last else 0
    if cut:  # rank 0 computes vocabulary rows [0, cut) of the head (pipeline_head.py)
        stage_config, weights = last_stage_inputs(model_config, weights, cut)
        model = LastStageHead(build_rank_model(cfg, stage_config, weights, tp, device, pp))
    else:
        model = build_rank_model(cfg, model_config, weights, tp, device, pp)
    del weights  # keep only this rank's shard
    if spec.kv_path is not None:  # fp32 only: the engine refuses a half KV dtype with it
        from pdserve.common.distributed.kv_share import map_rank_kv
        caches = map_rank_kv(spec.kv_path, model_config, place, spec.num_blocks,
                             cfg.cache.block_size)
    else:
        caches = allocate_kv_caches(model_config, (place.tp_rank, place.tp_size),
                                    spec.num_blocks, cfg.cache.block_size, device,
                                    engine_kv_dtype(cfg), pp)
    link = None
    if place.pp_size > 1:
        link = StageLink(place, model_config.hidden_size, resolve_dtype(cfg.dtype, device),
                         model_config.vocab_size, device, spec.kv_path is not None)
    return ModelRunner(model, caches, cfg.cache.block_size, device), link


def _build_rank_kv(spec: WorkerSpec, runner, conn, lock: threading.Lock):
    """This rank's own KV transfers (None without spec.rank_kv); each report goes to rank 0
    from the transfers' I/O thread, under `lock` (the main thread sends errors on conn too)."""
    if spec.rank_kv is None:
        return None
    from pdserve.common.distributed.layout import RankPlace

    par = spec.config.parallel

    def send(report) -> None:
        with lock:
            try:
                conn.send(("kv", report))
            except OSError:  # rank 0 is gone: the parent watch ends this process
                pass

    place = RankPlace(spec.rank, par.tensor_parallel_size, par.pipeline_parallel_size)
    return spec.rank_kv.build(runner.kv_caches, place, send)


def _loop(conn, runner, link, kv=None) -> None:
    """Steps in order until told to stop. `link`: the pipeline hand-off (None without
    stages); `kv`: this rank's KV transfers (None without them)."""
    pp = runner.model.pp
    send_logits = pp.is_last and link is not None and link.place.tp_rank == 0
    while True:
        payload = conn.recv_bytes()
        out = pickle.loads(payload)
        if out is None:  # rank 0 collected every step: no send is still wanted
            return
        if not out.chunks:  # transfers only (rank 0 sends none without a RankKV)
            for t in out.transfers:
                kv.start(t)
            continue
        hidden_in = None if pp.is_first else link.recv_hidden(out.num_tokens)
        result = runner.execute(out, hidden_in=hidden_in)
        if not pp.is_last:
            link.send_hidden(result)  # [T, hidden]
        elif send_logits:
            link.send_logits(result)  # [N, vocab] (N = 0: nothing, or the end-of-step mark)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
