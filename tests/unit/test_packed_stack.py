"""The whole stack of packed layers in one native call (packed_stack.py,
`packed_decode_layers`): bit-identical to one call per layer, equal logprobs to the module
path, and its inputs checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.common.models.packed_layer import DecodeStep
from pdserve.common.models.packed_stack import PackedStack
from pdserve.common.sampling_params import SamplingParams
from pdserve.tests.unit.packed_helpers import engine
from pdserve.tests.unit.test_packed_layer import (H, HEADS, KV_HEADS, VOCAB,
                                                  assert_equals_module_path, write_gguf)

D = H // HEADS


def packed_model(tmp_path, v_tail: bool = False):
    write_gguf(tmp_path / "m.gguf", v_tail)
    ours = engine(tmp_path / "m.gguf", True)
    return ours, ours.engine.model


def decode_step(batch: int, blocks: int = 4) -> DecodeStep:
    """`batch` decodes whose contexts (5, 21, 37 tokens) cross 16-token blocks."""
    g = torch.Generator().manual_seed(batch)
    lens = torch.tensor([5 + 16 * r for r in range(batch)], dtype=torch.int32)
    tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    slots = torch.tensor([int(tables[r, (n - 1) // 16]) * 16 + (n - 1) % 16
                          for r, n in enumerate(lens.tolist())], dtype=torch.int64)
    cos, sin = torch.rand(batch, D, generator=g), torch.rand(batch, D, generator=g)
    return DecodeStep(cos, sin, slots, tables, lens)


@pytest.mark.parametrize("v_tail", [False, True], ids=["uniform", "v-tail"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_stack_is_bit_identical_to_one_call_per_layer(tmp_path, batch, kv_dtype, v_tail):
    _, model = packed_model(tmp_path, v_tail)
    gemm, stack = model._packed_gemm, model._packed_stack
    assert stack is not None and len(stack.ln1) == 2
    assert len(stack.tails) == (2 if v_tail else 0)  # layer 0's tail, None for layer 1
    g = torch.Generator().manual_seed(7)
    x = torch.randn(batch, H, generator=g)
    caches = [torch.randn(2, 4 * batch, 16, KV_HEADS, D, generator=g).to(kv_dtype)
              for _ in range(2)]
    step = decode_step(batch)
    layer_caches = [c.clone() for c in caches]
    y = x
    for layer, cache in zip(model._packed_layers, layer_caches):
        y = layer.forward(gemm, None, None, y, cache, step)
    ours = stack.forward(gemm, x, caches, step)
    assert torch.equal(ours, y) and torch.isfinite(ours).all()
    assert all(torch.equal(a, b) for a, b in zip(caches, layer_caches))
    assert not torch.equal(caches[0], layer_caches[0].zero_())  # the step wrote K/V


@pytest.mark.parametrize("batch,threads", [(1, None), (3, None), (1, 1), (1, 3)])
def test_stack_equals_the_module_path(tmp_path, batch, threads):
    """Steps of 1 or 3 decodes run every layer in one native call, with logprobs equal to the
    module path's, over contexts that cross cache blocks. Batch 1 also at 1 thread and at more
    threads than its attention has context parts (a thread with no part; the last one writes
    the token's K/V)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        _stack_equals_the_module_path(tmp_path, batch)
    finally:
        torch.set_num_threads(before)


def _stack_equals_the_module_path(tmp_path, batch):
    ours, model = packed_model(tmp_path)
    stack, calls = model._packed_stack, []
    object.__setattr__(stack, "forward", lambda gemm, x, kv, step, f=type(stack).forward:
                       calls.append(len(x)) or f(stack, gemm, x, kv, step))
    prompts = [[(5 * i + 11 * j) % (VOCAB - 1) + 1 for i in range(4 + 9 * j)]
               for j in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    fast = ours.generate(prompts, params)
    assert len(calls) >= 39 and max(calls) == batch  # every decode step
    assert_equals_module_path(ours, prompts, params, fast)


def test_stack_rejects_inconsistent_inputs(tmp_path):
    _, model = packed_model(tmp_path)
    gemm, stack = model._packed_gemm, model._packed_stack
    with pytest.raises(ValueError, match="one entry per layer"):
        PackedStack(stack.ln1, stack.ln2[:1], stack.eps, stack.qkv, stack.o, stack.gate_up,
                    stack.down, stack.qtypes, stack.biases, stack.num_heads, stack.scale)
    with pytest.raises(ValueError, match="four entries per layer"):
        PackedStack(stack.ln1, stack.ln2, stack.eps, stack.qkv, stack.o, stack.gate_up,
                    stack.down, stack.qtypes[:7], stack.biases, stack.num_heads, stack.scale)
    x, step = torch.randn(1, H), decode_step(1)
    cache = torch.zeros(2, 4, 16, KV_HEADS, D)
    with pytest.raises(ValueError, match="one shape and dtype"):
        stack.forward(gemm, x, [cache, torch.zeros(2, 5, 16, KV_HEADS, D)], step)
    with pytest.raises(ValueError, match="one shape and dtype"):
        stack.forward(gemm, x, [cache, cache.bfloat16()], step)
    with pytest.raises(ValueError, match="one entry per layer"):
        stack.forward(gemm, x, [cache], step)
    bad = DecodeStep(step.cos, step.sin, torch.tensor([64]), step.block_tables, step.seq_lens)
    with pytest.raises(ValueError, match="outside the cache"):
        stack.forward(gemm, x, [cache, cache], bad)
    wrong_k = tuple(w[:, :10] for w in stack.qkv)
    with pytest.raises(ValueError):
        PackedStack(stack.ln1, stack.ln2, stack.eps, wrong_k, stack.o, stack.gate_up,
                    stack.down, stack.qtypes, stack.biases, stack.num_heads,
                    stack.scale).forward(gemm, x, [cache, cache], step)


def test_stack_rejects_inconsistent_qkv_tails(tmp_path):
    _, model = packed_model(tmp_path, v_tail=True)
    gemm, stack = model._packed_gemm, model._packed_stack
    with pytest.raises(ValueError, match="qkv tails"):
        dataclasses.replace(stack, tails=stack.tails[:1])
    with pytest.raises(ValueError, match="qkv tails"):
        dataclasses.replace(stack, tails=(), tail_qtypes=(), tail_biases=stack.tail_biases)
    # the kernel checks the head's rows against the tail's: layer 0 without its tail is short
    no_tail = dataclasses.replace(stack, tails=(None, None))
    with pytest.raises(ValueError, match="qkv: weight must have"):
        no_tail.forward(gemm, torch.randn(1, H), [torch.zeros(2, 4, 16, KV_HEADS, D)] * 2,
                        decode_step(1))


def test_stack_only_for_layers_of_one_eps_heads_and_scale(tmp_path):
    _, model = packed_model(tmp_path)
    layers = model._packed_layers
    assert PackedStack.of(layers) == model._packed_stack
    assert PackedStack.of([layers[0], dataclasses.replace(layers[1], scale=0.5)]) is None
    assert PackedStack.of([layers[0], dataclasses.replace(layers[1], eps=1e-3)]) is None
