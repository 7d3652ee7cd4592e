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
