import pytest
import torch

from pdserve.connector.codec import HEADER_SIZE, BlockCodec, BlockCodecError

FP = "0f" * 32


def codec(**kw):
    args = dict(fingerprint=FP, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    args.update(kw)
    return BlockCodec(**args)


def encoded(c, key=b"k" * 32):
    block = torch.randn(c.payload_shape)
    buf = bytearray(c.nbytes)
    return block, memoryview(c.encode_into(key, block, buf))


def test_round_trip_and_alignment():
    c = codec()
    block, data = encoded(c)
    assert HEADER_SIZE % 64 == 0 and len(data) == c.nbytes
    assert torch.equal(c.decode(b"k" * 32, data), block)


@pytest.mark.parametrize("other, reason", [
    (dict(fingerprint="aa" * 32), "model fingerprint"), (dict(block_size=8), "block_size"),
    (dict(num_layers=3), "layers"), (dict(head_dim=4), "head_dim"),
    (dict(dtype=torch.float16), "dtype"),
])
def test_mismatch_is_rejected(other, reason):
    _, data = encoded(codec())
    with pytest.raises(BlockCodecError, match=reason):
        codec(**other).decode(b"k" * 32, data)


def test_wrong_key_corruption_and_truncation_are_rejected():
    c = codec()
    _, data = encoded(c)
    with pytest.raises(BlockCodecError, match="key"):
        c.decode(b"x" * 32, data)
    bad = bytearray(data)
    bad[HEADER_SIZE + 3] ^= 1
    with pytest.raises(BlockCodecError, match="MAC"):
        c.decode(b"k" * 32, memoryview(bad))
    with pytest.raises(BlockCodecError):
        c.decode(b"k" * 32, data[:100])


def test_each_encoding_draws_a_fresh_nonce_and_a_mac_is_bound_to_its_nonce():
    """The one-time Poly1305 key comes from the nonce: the same block encoded twice gets two
    nonces (a repeated one-time key would be forgeable), and a tag moved under another
    nonce does not verify."""
    from pdserve.connector.codec import NONCE_BYTES
    c = codec(mac_key=b"s" * 32)
    block = torch.randn(c.payload_shape)
    a = memoryview(c.encode_into(b"k" * 32, block, bytearray(c.nbytes)))
    b = bytearray(c.encode_into(b"k" * 32, block, bytearray(c.nbytes)))
    mac_at = HEADER_SIZE - 1 - 32  # the MAC field sits just before the padding byte
    assert bytes(a[mac_at:mac_at + NONCE_BYTES]) != bytes(b[mac_at:mac_at + NONCE_BYTES])
    assert torch.equal(c.decode(b"k" * 32, a), c.decode(b"k" * 32, memoryview(b)))
    b[mac_at:mac_at + NONCE_BYTES] = a[mac_at:mac_at + NONCE_BYTES]
    with pytest.raises(BlockCodecError, match="MAC"):
        c.decode(b"k" * 32, memoryview(b))


def test_a_block_made_under_another_mac_key_is_rejected():
    block, data = encoded(codec(mac_key=b"a" * 32))
    with pytest.raises(BlockCodecError, match="MAC"):
        codec(mac_key=b"b" * 32).decode(b"k" * 32, data)
