import pytest

from pdserve.common.kv.memory import available_memory_bytes, plan_kv_blocks


def test_plan_from_bytes_blocks_and_fraction():
    p = plan_kv_blocks(1000, 16, budget_bytes=160_000)
    assert p.num_blocks == 10 and p.num_tokens == 160
    assert plan_kv_blocks(1000, 16, num_blocks=7).num_blocks == 7
    assert "10 blocks x 16 tokens = 160 tokens" in p.describe()
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_blocks(1000, 16, budget_bytes=100)


def test_cgroup_limit_caps_free_memory(tmp_path):
    (tmp_path / "memory.max").write_text("4096\n")
    (tmp_path / "memory.current").write_text("1024\n")
    assert available_memory_bytes(cgroup_dir=str(tmp_path)) == 3072
    (tmp_path / "memory.max").write_text("max\n")
    assert available_memory_bytes(cgroup_dir=str(tmp_path)) > 3072  # the host's MemAvailable
