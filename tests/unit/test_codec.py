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
