"""Fuzz (hypothesis) of the block codec and the storage node's wire protocol.

Properties: the codec either decodes a block that verifies or raises BlockCodecError, never
anything else; a storage node served arbitrary bytes never crashes, never allocates from a
peer's length field, and keeps serving honest requests; its segment changes only through a
WRITE carrying a valid capability.
"""

import asyncio
import socket

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.connector.codec import HEADER_SIZE, BlockCodec, BlockCodecError
from pdserve.connector.io_thread import IOThread
from pdserve.connector.kvstore.auth import derive, sign_capability
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.transport import framing
from pdserve.connector.transport.tcp import TcpTransport
from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler

CODEC = BlockCodec("0f" * 32, 2, 4, 2, 8, mac_key=b"k" * 32)
KEY = b"K" * 32
GOOD = bytes(CODEC.encode_into(KEY, torch.randn(CODEC.payload_shape), bytearray(CODEC.nbytes)))
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.binary(max_size=CODEC.nbytes + 64))
def test_codec_decode_of_random_bytes_only_raises_codec_errors(data):
    try:
        CODEC.decode(KEY, memoryview(data))
    except BlockCodecError:
        return
    assert data[:CODEC.nbytes] == GOOD  # only a genuine block decodes


@FUZZ
@given(st.lists(st.tuples(st.integers(0, CODEC.nbytes - 1), st.integers(1, 255)), min_size=1,
                max_size=8))
def test_codec_rejects_every_altered_block(flips):
    bad = bytearray(GOOD)
    for pos, x in flips:
        bad[pos] ^= x
    if bytes(bad) == GOOD:
        return
    try:
        CODEC.decode(KEY, memoryview(bad))
    except BlockCodecError:
        return
    raise AssertionError("an altered block decoded")


def test_codec_rejects_each_single_byte_change():
    """Exhaustive over one byte (the random search above found the header's padding byte
    only sometimes): any change anywhere in the block is rejected."""
    for pos in range(CODEC.nbytes):
        bad = bytearray(GOOD)
        bad[pos] ^= 0x80
        try:
            CODEC.decode(KEY, memoryview(bad))
        except BlockCodecError:
            continue
        raise AssertionError(f"a block with byte {pos} changed decoded")


# ---- the node's wire protocol over a live TCP listener ---------------------------------

GRANT = derive(b"s" * 32, b"grant")
CAP = 1 << 16


class _Node:
    def __init__(self):
        self.io = IOThread("fuzz-node")
        self.segment = Segment(CAP)
        handler = SegmentHandler(self.segment, GrantCheck(GRANT, "n0", 0.0))

        async def listen():
            # the storage node's own listener: a thread per connection (node.py)
            return await TcpTransport().listen_threads("127.0.0.1", 0, handler)
        self.listener = self.io.run(listen(), 10)
        self.port = self.listener.port

    def close(self):
        self.io.run(self.listener.close(), 10)
        self.io.close()


_NODE = None


def _node() -> _Node:
    global _NODE
    if _NODE is None:
        _NODE = _Node()
    return _NODE


def _honest_read_works(node: _Node) -> None:
    cap = sign_capability(GRANT, READ, "n0", 0, 64, 4e9)
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(framing.pack(framing.KIND_REQUEST, NodeOp(READ, 0, 64, cap).encode(), 0))
        kind, hlen, plen = framing.PREFIX.unpack(_recv(s, framing.PREFIX.size))
        assert kind == framing.KIND_OK and plen == 64
        _recv(s, hlen + plen)


def _recv(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "node closed an honest connection"
        buf += chunk
    return buf


def _header_strategy():
    ops = st.sampled_from([READ, WRITE])
    num = st.integers(0, 2**64 - 1) | st.integers(0, CAP + 64)
    cap = st.sampled_from([b"", bytes(40)]) | st.binary(min_size=40, max_size=40)
    structured = st.builds(lambda o, a, b, c: NodeOp(o, a, b, c).encode(), ops, num, num, cap)
    return structured | st.binary(max_size=80)


@FUZZ
@given(kind=st.integers(0, 3), header=_header_strategy(),
       claimed=st.integers(0, 2**64 - 1) | st.integers(0, 4096),
       body=st.binary(max_size=256), trailing=st.binary(max_size=64))
def test_node_survives_any_frame_and_keeps_its_segment(kind, header, claimed, body, trailing):
    node = _node()
    before = bytes(node.segment.view)
    frame = framing.PREFIX.pack(kind, len(header), claimed) + header + body + trailing
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):  # whatever it answers, until it closes
                pass
        except OSError:  # reset, broken pipe, not connected: the node dropped us
            pass
    assert bytes(node.segment.view) == before  # no valid capability: not a byte written
    _honest_read_works(node)


def teardown_module():
    if _NODE is not None:
        _NODE.close()
