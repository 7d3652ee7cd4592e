"""tests/gguf_parse_cache.py: inside `active()` a file is parsed once and a name table built
once, the values are gguf-py's own, and outside it gguf-py is untouched."""

import gguf
import numpy as np

from pdserve.tests.gguf_parse_cache import GgufParseCache


def _tiny_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_one_parse_per_file_and_one_table_per_arch(tmp_path):
    path = tmp_path / "tiny.gguf"
    _tiny_gguf(path)
    cache = GgufParseCache()
    original, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with cache.active():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is table
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3) is not table
    assert gguf.GGUFReader is original and gguf.get_tensor_name_map is original_map
    fresh = original(path)
    assert first is not fresh and list(first.fields) == list(fresh.fields)
    assert [t.name for t in first.tensors] == [t.name for t in fresh.tensors] == ["token_embd.weight"]
    assert np.array_equal(first.tensors[0].data, fresh.tensors[0].data)
    assert table.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    with cache.active():  # the cache outlives one `with`
        assert gguf.GGUFReader(path) is first
