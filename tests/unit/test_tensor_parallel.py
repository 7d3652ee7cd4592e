"""Tensor parallel on the CPU: greedy tokens with T ranks equal T=1 and transformers (with and
without GQA, KV heads and a vocabulary the ranks split unevenly, chunked prefill, prefix hits
and preemption in the run); more ranks than KV heads are refused before any process starts;
a worker killed mid-run ends the engine with an error and leaves no process behind."""

import os
import signal
import threading
import time

import pytest
import torch

from pdserve.common.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.common.distributed.executor import WorkerDiedError
from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.llm import LLM
from pdserve.common.models.hf_loader import load_hf_dir
from pdserve.common.models.registry import LoadedModel, load_model, model_fingerprint
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# the long prompt is chunked (16-token budget); the repeated one hits the prefix cache
PROMPTS = [[3, 17, 42, 99, 5], list(range(30, 70)), list(range(30, 62)) + [7, 8]]
# hidden, heads, kv heads, vocabulary (322 does not split evenly over 4 ranks: the last shard
# pads), tied embeddings, (tensor-parallel size, all-reduce) runs
MODELS = {"gqa": (64, 8, 4, 322, False, ((2, "gloo"), (4, "shm"))),
          "mha-tied": (64, 4, 4, 320, True, ((2, "shm"), (4, "shm"))),
          # 3 KV heads over 2 ranks: rank 0 holds 2 (and 4 query heads), rank 1 one (and 2)
          "gqa-uneven": (48, 6, 3, 320, False, ((2, "shm"), (3, "gloo")))}


def hf_model(name, tmp_path):
    hidden, heads, kv_heads, vocab, tied, _ = MODELS[name]
    return build_hf_model(tmp_path, hidden, heads, kv_heads, vocab, tied)


def build_hf_model(tmp_path, hidden, heads, kv_heads, vocab, tied, layers=2):
    """A random transformers Llama saved to tmp_path, and the same model loaded as ours."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96,
                                   num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, max_position_embeddings=256,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.5)
    hf.save_pretrained(tmp_path)
    config, weights = load_hf_dir(tmp_path)
    return hf, LoadedModel(config, weights, Tokenizer.tiny(), model_fingerprint(config, weights))


def engine_config(tp, all_reduce="auto", num_blocks=64, budget=16, block_size=16):
    return EngineConfig(model="tiny", num_threads=1,
                        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                  max_model_len=256),
                        parallel=ParallelConfig(tensor_parallel_size=tp, all_reduce=all_reduce))


def generate(loaded, tp, all_reduce="auto", num_blocks=64, block_size=16):
    return run_engine(engine_config(tp, all_reduce, num_blocks, block_size=block_size), loaded,
                      PROMPTS)


def run_engine(config, loaded, *batches):
    """Greedy tokens of each batch of prompts in turn (one list), and the engine's stats."""
    llm = LLM(config, loaded=loaded)
    try:
        outs = [o for batch in batches for o in llm.generate(batch, GREEDY)]
        return [o.token_ids for o in outs], llm.engine.stats()
    finally:
        llm.engine.close()


def hf_greedy(hf, prompts):
    return [hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tp_equals_tp1_and_transformers(name, tmp_path):
    hf, loaded = hf_model(name, tmp_path)
    ref = hf_greedy(hf, PROMPTS)
    tp1, _ = generate(loaded, 1)
    assert tp1 == ref
    for tp, all_reduce in MODELS[name][5]:
        got, stats = generate(loaded, tp, all_reduce)
        assert got == ref, (name, tp, all_reduce)
        assert stats.prefix_cache_hits >= 16  # the third prompt reused the second's blocks


def test_greedy_tp2_with_preemption(tmp_path):
    _, loaded = hf_model("gqa", tmp_path)
    tp1, s1 = generate(loaded, 1, num_blocks=20, block_size=4)
    tp2, s2 = generate(loaded, 2, num_blocks=20, block_size=4)
    assert s1.num_preemptions > 0 and s2.num_preemptions > 0
    assert tp2 == tp1


def test_heads_that_do_not_split_are_refused_before_any_process_starts():
    loaded = load_model("tiny")  # 4 heads, 2 KV heads
    before = _children()
    with pytest.raises(ValueError, match="larger than the model's 2 KV heads"):
        EngineCore(engine_config(4), loaded)
    with pytest.raises(ValueError, match="larger than the model's 2 KV heads"):
        EngineCore(engine_config(3), loaded)
    assert _children() == before


@pytest.mark.parametrize("all_reduce", ["shm", "gloo"])
def test_a_killed_worker_ends_the_engine_with_an_error_and_no_leftovers(all_reduce):
    core = EngineCore(engine_config(2, all_reduce, num_blocks=64, budget=64), load_model("tiny"))
    workers = core.executor.workers
    (proc,) = workers.procs
    core.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=200, ignore_eos=True))
    core.step()
    kill_while_stepping(core, proc)
    assert proc.pid not in _children()


def kill_while_stepping(core, proc):
    """Kill `proc` while rank 0 keeps stepping (inside a collective or between steps): a
    step raises WorkerDiedError, and every later one; every worker is reaped; close."""
    killer = threading.Timer(0.2, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    deadline = time.monotonic() + 60
    with pytest.raises(WorkerDiedError):
        while time.monotonic() < deadline:
            core.step()
    killer.join()
    assert all(p.poll() is not None for p in core.executor.workers.procs)  # reaped
    with pytest.raises(WorkerDiedError):
        core.step()  # and it stays dead
    core.close()


def test_workers_stop_cleanly_on_close():
    core = EngineCore(engine_config(2, num_blocks=16), load_model("tiny"))
    pids = {p.pid for p in core.executor.workers.procs}
    assert pids <= _children()
    core.close()
    core.close()  # idempotent
    assert not pids & _children()
    assert all(p.returncode == 0 for p in core.executor.workers.procs)


def _children() -> set[int]:
    """Pids of this process's live (not zombie) children."""
    me, kids = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            kids.add(int(pid))
    return kids


def test_a_dead_worker_makes_the_service_engine_unhealthy():
    core = EngineCore(engine_config(2, num_blocks=64, budget=64), load_model("tiny"))
    (proc,) = core.executor.workers.procs
    assert_service_dies_with(core, proc)


def assert_service_dies_with(core, proc):
    """Serve `core` (SERVING after its warm-up), kill `proc` mid-stream: the stream fails
    with the worker's death, Health says NOT_SERVING, and no process is left behind."""
    import asyncio

    from pdserve.common.rpc import engine_pb2 as pb
    from pdserve.services.engine_host.async_engine import AsyncEngine, EngineDeadError
    from pdserve.services.engine_host.health import InstanceInfo, health_response

    info = InstanceInfo(model="tiny", role="unified", max_model_len=core.max_model_len,
                        vocab_size=core.tokenizer.vocab_size, fingerprint=core.fingerprint,
                        block_size=16)

    async def main():
        engine = AsyncEngine(core)
        engine.start(asyncio.get_running_loop())
        try:
            assert await engine.wait_warmed_up()  # SERVING only after the warm-up
            assert health_response(engine, info).status == pb.HealthResponse.SERVING
            stream = await engine.submit("r", list(range(1, 30)),
                                         SamplingParams(max_tokens=200, ignore_eos=True))
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="WorkerDiedError"):
                async for _ in stream:
                    pass
            assert not engine.healthy
            return health_response(engine, info).status
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)
            core.close()

    assert asyncio.run(main()) == pb.HealthResponse.NOT_SERVING
    assert proc.pid not in _children()


def test_an_error_in_rank_0s_forward_stops_the_workers():
    core = EngineCore(engine_config(2, num_blocks=16), load_model("tiny"))
    (proc,) = core.executor.workers.procs
    layer = core.model.layers[1].mlp

    def broken(*args, **kwargs):  # after layer 0's all-reduces: the worker waits in layer 1
        raise RuntimeError("boom")

    layer.forward = broken
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="boom"):
        core.step()
    assert proc.poll() is not None  # not left waiting in a collective
    with pytest.raises(WorkerDiedError):
        core.step()
    core.close()
