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


def test_total_budget_gives_the_kv_what_the_weights_leave():
    from pdserve.common.kv.memory import WeightsFootprint
    packed, fp32 = WeightsFootprint(40_000, 160_000), WeightsFootprint(160_000, 160_000)
    a = plan_kv_blocks(1000, 16, memory_budget_bytes=200_000, weights=packed)
    b = plan_kv_blocks(1000, 16, memory_budget_bytes=200_000, weights=fp32)
    assert (a.num_blocks, b.num_blocks) == (10, 2)
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_blocks(1000, 16, memory_budget_bytes=100_000, weights=fp32)
    with pytest.raises(ValueError, match="not both"):
        plan_kv_blocks(1000, 16, budget_bytes=1, memory_budget_bytes=200_000)
    assert "39.1 KiB" not in packed.describe() and "MiB resident" in packed.describe()
