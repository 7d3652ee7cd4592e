"""The master's edge checks: every size, count and number a caller controls is bounded."""

import math

import pytest

from pdserve.services.kvstore import limits
from pdserve.services.kvstore.config import MasterConfig

CFG = MasterConfig(max_lease_s=100.0, max_node_capacity=1 << 20, max_batch_keys=4,
                   max_replicas=2, replica_num=1)


@pytest.mark.parametrize("lease", [math.nan, math.inf, -math.inf, -1.0, 100.5, 1e308])
def test_bad_leases_are_refused(lease):
    with pytest.raises(ValueError, match="lease_s"):
        limits.check_put_start(b"k" * 32, 10, lease, 1, CFG)


@pytest.mark.parametrize("lease", [0.0, 0.5, 100.0])
def test_good_leases_pass(lease):
    limits.check_put_start(b"k" * 32, 10, lease, 1, CFG)


@pytest.mark.parametrize("key,size,replicas", [
    (b"", 10, 1), (b"k" * 65, 10, 1), (b"k", 0, 1), (b"k", (1 << 20) + 1, 1), (b"k", 10, 3)])
def test_bad_put_starts_are_refused(key, size, replicas):
    with pytest.raises(ValueError):
        limits.check_put_start(key, size, 1.0, replicas, CFG)


def test_batches_are_bounded():
    assert limits.check_keys([b"a", b"b"], CFG) == [b"a", b"b"]
    with pytest.raises(ValueError, match="at most 4 keys"):
        limits.check_keys([b"a"] * 5, CFG)
    with pytest.raises(ValueError, match="key must be"):
        limits.check_keys([b"a", b"x" * 100], CFG)


@pytest.mark.parametrize("node_id,address,capacity,incarnation", [
    ("", "h:1", 10, "i"), ("n" * 129, "h:1", 10, "i"), ("n", "nohostport", 10, "i"),
    ("n", "h:1", 0, "i"), ("n", "h:1", (1 << 20) + 1, "i"), ("n", "h:1", 2**63, "i"),
    ("n", "h:1", 10, "i" * 65), ("n", "h:" + "1" * 300, 10, "i")])
def test_bad_node_registrations_are_refused(node_id, address, capacity, incarnation):
    with pytest.raises(ValueError):
        limits.check_node(node_id, address, capacity, incarnation, CFG)


def test_config_refuses_non_finite_bounds():
    with pytest.raises(ValueError):
        MasterConfig(max_lease_s=math.inf)
    with pytest.raises(ValueError):
        MasterConfig(read_lease_s=math.nan)


def test_put_batches_are_bounded_and_each_entry_checked():
    from types import SimpleNamespace as E

    cfg = MasterConfig(max_lease_s=100.0, max_node_capacity=1 << 20, max_batch_puts=2)
    ok = E(key=b"k", size=10, lease_s=1.0, replica_num=1)
    limits.check_put_batch([ok, ok], cfg)
    with pytest.raises(ValueError, match="at most 2 puts"):
        limits.check_put_batch([ok] * 3, cfg)
    with pytest.raises(ValueError, match="lease_s"):
        limits.check_put_batch([ok, E(key=b"k", size=10, lease_s=math.nan, replica_num=1)],
                               cfg)
    assert limits.check_put_keys([b"a", b"b"], cfg) == [b"a", b"b"]
    with pytest.raises(ValueError, match="at most 2 puts"):
        limits.check_put_keys([b"a"] * 3, cfg)
    with pytest.raises(ValueError, match="key must be"):
        limits.check_put_keys([b""], cfg)
    with pytest.raises(ValueError, match="max_batch_puts"):
        MasterConfig(max_batch_puts=0)
