"""oneDNN-packed linears (common/models/cpu_gemm.py) against torch's unfused ops."""

import pytest
import torch

from pdserve.common.models.cpu_gemm import onednn_available, pack_linears, resolve_cpu_gemm
from pdserve.common.models.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                          QKVParallelLinear, RowParallelLinear)


def test_pinned_torch_has_onednn():
    # the engine's CPU default rests on it; a torch without it would silently run ~2x slower
    assert onednn_available()


def _filled(layer):
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return layer


def test_resolve_rules():
    assert resolve_cpu_gemm("torch", "cpu") == "torch"
    assert resolve_cpu_gemm("auto", "cuda") == "torch"
    assert resolve_cpu_gemm("auto", "cpu") == ("onednn" if onednn_available() else "torch")
    with pytest.raises(ValueError, match="cpu_gemm"):
        resolve_cpu_gemm("mkl", "cpu")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_layers_match_torch(rows):
    layers = {"col": ColumnParallelLinear(48, 40, bias=True),
              "qkv": QKVParallelLinear(48, 8, 4, 2, bias=True),
              "gate_up": MergedColumnParallelLinear(48, [56, 56], bias=True),
              "row": RowParallelLinear(56, 48, bias=True)}
    for layer in layers.values():
        _filled(layer)
    x = torch.randn(rows, 48)
    h = torch.randn(rows, 56)
    res = torch.randn(rows, 48)
    before = {"col": layers["col"](x), "qkv": layers["qkv"](x),
              "gate_up": layers["gate_up"](x), "silu_mul": layers["gate_up"].silu_and_mul(x),
              "row": layers["row"](h), "row_res": layers["row"](h, res)}
    container = torch.nn.ModuleList(layers.values())
    assert pack_linears(container) == 4
    assert all(layer.weight is None for layer in layers.values())
    after = {"col": layers["col"](x), "qkv": layers["qkv"](x),
             "gate_up": layers["gate_up"](x), "silu_mul": layers["gate_up"].silu_and_mul(x),
             "row": layers["row"](h), "row_res": layers["row"](h, res)}
    for name in before:
        torch.testing.assert_close(after[name], before[name], atol=2e-5, rtol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_engine_greedy_same_with_and_without_packing():
    from pdserve.common.config import CacheConfig, EngineConfig
    from pdserve.common.engine.llm import LLM
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 2, 7], list(range(3, 40))]
    outs = {}
    for gemm in ("torch", "onednn"):
        # a small cache: the default plan would size (and zero) ~700k blocks from free memory
        llm = LLM(EngineConfig(model="tiny", cpu_gemm=gemm, num_threads=1,
                               cache=CacheConfig(num_blocks=128)))
        model = llm.engine.executor.runner.model  # rank 0's (the only rank here)
        packed = [m for m in model.modules() if getattr(m, "packed", None) is not None]
        assert bool(packed) == (gemm == "onednn")
        outs[gemm] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["torch"] == outs["onednn"]
