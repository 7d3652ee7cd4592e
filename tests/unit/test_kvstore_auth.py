"""Capabilities and tokens of the store path: what they bind, when they expire, how secrets
are read, and that keys never show in a repr."""

import pytest

from pdserve.connector.kvstore import auth
from pdserve.connector.kvstore.node_protocol import READ, WRITE, NodeOp
from pdserve.connector.transport import FrameRejected
from pdserve.services.kvstore.segment import GrantCheck, Segment, SegmentHandler

KEY = auth.derive(b"s" * 32, b"grant")


def _cap(op=READ, node="n0", offset=64, length=128, expiry=1000.0, key=KEY):
    return auth.sign_capability(key, op, node, offset, length, expiry)


def test_capability_binds_op_node_range_and_expiry():
    cap = _cap()
    auth.check_capability(KEY, READ, "n0", 64, 128, cap, now_s=999.0, skew_s=0)
    for args in ((WRITE, "n0", 64, 128), (READ, "n1", 64, 128), (READ, "n0", 0, 128),
                 (READ, "n0", 64, 129)):
        with pytest.raises(auth.AuthError, match="does not grant"):
            auth.check_capability(KEY, *args, cap, now_s=999.0, skew_s=0)
    with pytest.raises(auth.AuthError, match="expired"):
        auth.check_capability(KEY, READ, "n0", 64, 128, cap, now_s=1001.0, skew_s=0.5)
    auth.check_capability(KEY, READ, "n0", 64, 128, cap, now_s=1001.0, skew_s=2)  # skew
    other = _cap(key=auth.derive(b"t" * 32, b"grant"))
    with pytest.raises(auth.AuthError):
        auth.check_capability(KEY, READ, "n0", 64, 128, other, now_s=999.0, skew_s=0)
    bumped = auth.CAPABILITY.pack(10**12, auth.CAPABILITY.unpack(cap)[1])  # a longer expiry
    with pytest.raises(auth.AuthError, match="does not grant"):
        auth.check_capability(KEY, READ, "n0", 64, 128, bumped, now_s=999.0, skew_s=0)


def test_segment_handler_checks_the_grant_before_landing():
    seg = Segment(4096)
    clock = [999.0]
    h = SegmentHandler(seg, GrantCheck(KEY, "n0", 0.0, lambda: clock[0]))
    good = NodeOp(WRITE, 64, 128, _cap(WRITE)).encode()
    assert h.payload_buffer(good, 128).obj is seg.view.obj
    with pytest.raises(FrameRejected, match="refused"):
        h.payload_buffer(NodeOp(WRITE, 64, 128, _cap(READ)).encode(), 128)
    with pytest.raises(FrameRejected, match="refused"):
        h.payload_buffer(NodeOp(WRITE, 64, 128).encode(), 128)
    clock[0] = 2000.0
    with pytest.raises(FrameRejected, match="expired"):
        h.payload_buffer(good, 128)


def test_tokens_bind_label_body_and_age():
    key = auth.derive(b"s" * 32, b"admin")
    tok = auth.sign_token(key, b"remove", b"body", 100.0)
    auth.check_token(key, b"remove", b"body", tok, 130.0, 60.0)
    for label, body, now in ((b"register", b"body", 130.0), (b"remove", b"other", 130.0),
                             (b"remove", b"body", 200.0), (b"remove", b"body", 30.0)):
        with pytest.raises(auth.AuthError):
            auth.check_token(key, label, body, tok, now, 60.0)
    with pytest.raises(auth.AuthError):
        auth.check_token(key, b"remove", b"body", b"", 100.0, 60.0)


def test_read_secret_raw_and_env_file(tmp_path):
    raw = tmp_path / "raw"
    raw.write_text("  0123456789abcdef0123  \n")
    assert auth.read_secret(str(raw)) == b"0123456789abcdef0123"
    env = tmp_path / "env"
    env.write_text('PDSERVE_KV_SECRET="0123456789abcdefXYZ"\n')
    assert auth.read_secret(str(env)) == b"0123456789abcdefXYZ"
    short = tmp_path / "short"
    short.write_text("tooshort")
    with pytest.raises(ValueError, match="shorter"):
        auth.read_secret(str(short))


def test_keys_never_show_in_a_repr():
    keys = auth.StoreKeys.from_secret(b"s" * 32)
    blocks = auth.BlockKeys.from_secret(b"b" * 32)
    assert keys.grant.hex() not in repr(keys) and "redacted" in repr(keys)
    assert blocks.mac.hex() not in repr(blocks)
    assert len({keys.grant, keys.register, keys.admin, blocks.mac, blocks.object_salt}) == 5
    assert blocks.object_key(b"h" * 32) != b"h" * 32
    assert blocks.object_key(b"h" * 32) == auth.BlockKeys.from_secret(b"b" * 32).object_key(
        b"h" * 32)
