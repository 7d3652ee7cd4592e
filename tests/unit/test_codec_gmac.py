"""The block MAC's GMAC (cryptography's GCM encryptor fed in pieces) gives the tags of
cryptography's one-shot AES-256-GCM over associated data, for any split of the message into
parts and across piece boundaries (GMAC was format 4; it stays as `pdserve bench transport`'s
`tcp+cap+gmac` contender); a block of format 4 is refused now that the codec writes 5,
never misread."""

import os
import struct

import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdserve.connector import gmac
from pdserve.connector.codec import FORMAT_VERSION, BlockCodec, BlockCodecError


@pytest.mark.parametrize("sizes", [(0,), (1,), (15,), (16,), (17,), (128, 0, 5000),
                                   (128, 737280), (3, 3, 3, 3),
                                   (7, 2 * gmac.PIECE_BYTES + 9, 16)])
def test_tags_equal_cryptographys_aes_gcm(sizes):
    key = os.urandom(32)
    parts = [memoryview(bytearray(os.urandom(n))) for n in sizes]
    want = AESGCM(key).encrypt(gmac.IV, b"", b"".join(bytes(p) for p in parts))
    assert gmac.gmac_tag(key, parts) == want
    assert gmac.gmac_tag(key, [memoryview(bytes(p)) for p in parts]) == want  # read-only
    assert gmac.gmac_tag(key, [bytes(p) for p in parts]) == want


def test_a_changed_byte_or_key_changes_the_tag_and_bad_input_is_refused():
    key, msg = os.urandom(32), bytearray(os.urandom(1000))
    tag = gmac.gmac_tag(key, [memoryview(msg)])
    msg[999] ^= 0x80
    assert gmac.gmac_tag(key, [memoryview(msg)]) != tag
    assert gmac.gmac_tag(os.urandom(32), [memoryview(msg)]) != tag
    with pytest.raises(ValueError, match="32 bytes"):
        gmac.gmac_tag(b"short", [memoryview(b"x")])
    with pytest.raises(ValueError, match="contiguous"):
        gmac.gmac_tag(bytes(32), [memoryview(bytearray(64))[::2]])


def test_a_format_4_block_is_refused():
    codec = BlockCodec("0f" * 32, 2, 4, 1, 8, mac_key=b"k" * 32)
    buf = bytearray(codec.nbytes)
    codec.encode_into(b"b" * 32, torch.ones(codec.payload_shape), buf)
    assert FORMAT_VERSION == 5
    struct.pack_into("<H", buf, 4, 4)  # GMAC's version: the bench's `tcp+cap+gmac` only  # the version field, right after the magic
    with pytest.raises(BlockCodecError, match="version mismatch"):
        codec.decode(b"b" * 32, memoryview(buf))
