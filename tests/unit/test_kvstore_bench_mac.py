"""The transport bench's `tcp+cap+mac` contender MACs blocks with the codec's real MAC (so its
ratio to a raw socket is the cost of the production construction, not of a stand-in)."""

import pytest

from pdserve.bench import transport
from pdserve.connector.codec import BlockCodec, BlockCodecError


def test_bench_mac_is_the_codec_mac_a_reader_verifies():
    payload = bytes(range(8))  # the bench codec's geometry: 1x2x1x1x1 float32
    header = transport._codec_mac()(memoryview(payload))
    reader = BlockCodec("0f" * 32, 1, 1, 1, 1, mac_key=transport._MAC_KEY)
    reader.decode(b"k" * 32, memoryview(bytearray(header + payload)))
    with pytest.raises(BlockCodecError, match="MAC"):
        reader.decode(b"k" * 32, memoryview(bytearray(header + payload[:-1] + b"\xff")))


def test_unknown_contender_is_refused():
    with pytest.raises(ValueError, match="unknown transports"):
        transport.main(["--transports", "socket,tcp+cap+sha1"])


def test_summary_reports_throughput_and_cpu_ratios_per_size():
    mib, block = transport.MiB, transport.SMOLLM2_BLOCK_BYTES
    res = {"socket": {"gbps": {mib: 2.0, block: 3.0}, "rtt_us": 40.0,
                      "cpu_us_per_mib": {mib: 400.0, block: 500.0}},
           "tcp+cap": {"gbps": {mib: 1.0, block: 2.4}, "rtt_us": 300.0,
                       "cpu_us_per_mib": {mib: 1000.0, block: 500.0}}}
    s = transport._summary(res, [block, mib])
    assert s["ratio_vs_socket"]["tcp+cap"] == {"0.703": 0.8, "1": 0.5}
    assert s["cpu_ratio_vs_socket"]["tcp+cap"] == {"0.703": 1.0, "1": 2.5}
    assert s["min_ratio_vs_socket"] == 0.5


def test_cpu_seconds_counts_this_process():
    import os

    before = transport._cpu_seconds([os.getpid()])
    sum(i * i for i in range(200_000))
    assert transport._cpu_seconds([os.getpid()]) > before > 0
