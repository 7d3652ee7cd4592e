"""A tensor-parallel worker process (ranks 1..T-1; the engine process is rank 0).

Lifecycle, driven by rank 0 over a socket (`python -m pdserve.common.distributed.worker FD`):
1. receives its `WorkerSpec`; sends ("hello",), joins the torch.distributed group,
2. loads the model, keeps only its shard, allocates its part of the KV cache, and sends
   ("ready",) or ("error", message),
3. loops: receives a pickled SchedulerOutput and runs the forward (the collectives inside pair
   it with the other ranks); None, or the socket closing (rank 0 died), ends the loop.
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
from typing import Optional

import torch

from pdserve.common.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    store_port: int
    config: EngineConfig
    num_blocks: int
    # the model to load when the engine was given one in memory (tests); None -> by name
    model: Optional[tuple[ModelConfig, dict]] = None
    shm_path: Optional[str] = None  # the shared-memory all-reduce's buffers (shm_comm.py)
    slot_floats: int = 0
    kv_path: Optional[str] = None  # this rank's KV cache file (kv_share.py), with a connector


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
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {spec.rank}] %(message)s")
    comm = None
    try:
        conn.send(("hello",))
        comm = _join(spec, parent)
        runner = _build(spec, comm)
        conn.send(("ready",))
        _loop(conn, runner)
    except (EOFError, BrokenPipeError):
        pass  # rank 0 went away: nothing left to serve
    except BaseException as exc:  # report what we can, then die: rank 0 takes the engine down
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        log.exception("tensor-parallel worker failed")
        sys.exit(1)
    finally:
        if comm is not None:
            comm.close()


def _join(spec: WorkerSpec, parent: int):
    from pdserve.common.distributed.shm_comm import ShmCommunicator, attach_buffers
    from pdserve.common.distributed.torch_comm import init_group, make_store

    cfg = spec.config
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    store = make_store(spec.store_port, spec.world_size, is_master=False)
    comm = init_group(store, spec.rank, spec.world_size, cfg.device)
    if spec.shm_path is not None:
        shm = attach_buffers(spec.shm_path, spec.world_size, spec.slot_floats)
        comm = ShmCommunicator(spec.rank, spec.world_size, shm.ctrl, shm.data,
                               lambda: os.getppid() == parent, comm)
    return comm


def _build(spec: WorkerSpec, comm):
    from pdserve.common.distributed.layout import TensorParallel
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
    tp = TensorParallel(spec.rank, spec.world_size, comm)
    model = build_rank_model(cfg, model_config, weights, tp, device)
    del weights  # keep only this rank's shard
    if spec.kv_path is not None:  # fp32 only: the engine refuses a half KV dtype with it
        from pdserve.common.distributed.kv_share import map_rank_kv
        caches = map_rank_kv(spec.kv_path, model_config, spec.rank, spec.world_size,
                             spec.num_blocks, cfg.cache.block_size)
    else:
        caches = allocate_kv_caches(model_config, (spec.rank, spec.world_size),
                                    spec.num_blocks, cfg.cache.block_size, device,
                                    engine_kv_dtype(cfg))
    return ModelRunner(model, caches, cfg.cache.block_size, device)


def _loop(conn, runner) -> None:
    while True:
        payload = conn.recv_bytes()
        out = pickle.loads(payload)
        if out is None:
            return
        runner.execute(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
