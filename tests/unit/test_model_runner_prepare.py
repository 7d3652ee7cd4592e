"""The model runner's decode-step inputs (`_prepare_decodes`, one numpy call per field) are the
general path's (`_prepare_chunks`) for the same single-token chunks, tensor for tensor."""

from __future__ import annotations

import dataclasses

import torch

from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler_output import ScheduledChunk, SchedulerOutput


def _chunks():
    # contexts of 1, 16 (a block boundary), 17 and 300 tokens; block tables of uneven width
    return (ScheduledChunk("a", (5,), 0, (7,), True),
            ScheduledChunk("b", (11,), 15, (3,), True),
            ScheduledChunk("c", (12,), 16, (9, 4), True),
            ScheduledChunk("d", (13,), 299, tuple(range(40, 59)), True))


def test_decode_inputs_equal_the_general_path():
    runner = ModelRunner(model=None, kv_caches=[], block_size=16)
    chunks = _chunks()
    ids_a, pos_a, meta_a = runner._prepare_decodes(chunks)
    ids_a, pos_a = ids_a.clone(), pos_a.clone()  # views of the reused host buffers
    ids_b, pos_b, meta_b = runner._prepare_chunks(chunks)
    assert ids_a.tolist() == [5, 11, 12, 13] and torch.equal(ids_a, ids_b)
    assert pos_a.tolist() == [0, 15, 16, 299] and torch.equal(pos_a, pos_b)
    # slots: block 7 slot 0; block 3 slot 15; block 4 (the second) slot 0; block 58 slot 11
    assert meta_a.slot_mapping.tolist() == [112, 63, 64, 939]
    for f in dataclasses.fields(meta_a):
        a, b = getattr(meta_a, f.name), getattr(meta_b, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_a_step_with_a_prompt_chunk_takes_the_general_path():
    runner = ModelRunner(model=None, kv_caches=[], block_size=16)
    out = SchedulerOutput(_chunks()[:1] + (ScheduledChunk("e", (1, 2, 3), 0, (2,), True),))
    ids, pos, meta = runner._prepare(out)
    assert ids.tolist() == [5, 1, 2, 3] and pos.tolist() == [0, 0, 1, 2]
    assert meta.num_decodes == 1 and meta.query_lens_cpu == [1, 3]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
