"""The codec's Poly1305 (OpenSSL's EVP_MAC through ctypes, so the GIL is released) gives
cryptography's tags, for any split of the message into parts."""

import ctypes
import os

import pytest
from cryptography.hazmat.primitives.poly1305 import Poly1305

from pdserve.connector import poly1305


@pytest.mark.parametrize("sizes", [(0,), (1,), (15,), (16,), (17,), (128, 0, 5000),
                                   (128, 737280), (3, 3, 3, 3)])
def test_tags_equal_cryptographys(sizes):
    key = os.urandom(32)
    parts = [memoryview(bytearray(os.urandom(n))) for n in sizes]
    want = Poly1305(key)
    for p in parts:
        want.update(p)
    assert poly1305.poly1305_tag(key, parts) == want.finalize()
    tag = poly1305.poly1305_tag(key, parts)
    readonly = [memoryview(bytes(p)) for p in parts]  # read-only views, as a reader may pass
    assert poly1305.poly1305_tag(key, readonly) == tag
    assert poly1305.poly1305_tag(key, [bytes(p) for p in parts]) == tag  # and plain bytes


def test_a_changed_byte_or_key_changes_the_tag():
    key, msg = os.urandom(32), bytearray(os.urandom(1000))
    tag = poly1305.poly1305_tag(key, [memoryview(msg)])
    msg[500] ^= 1
    assert poly1305.poly1305_tag(key, [memoryview(msg)]) != tag
    assert poly1305.poly1305_tag(bytes(32 - 1) + b"\1", [memoryview(msg)]) != tag


def test_bad_key_length_and_strided_buffers_are_refused():
    with pytest.raises(ValueError, match="32 bytes"):
        poly1305.poly1305_tag(b"short", [memoryview(b"x")])
    with pytest.raises(ValueError, match="contiguous"):  # never a read past what it views
        poly1305.poly1305_tag(bytes(32), [memoryview(bytearray(64))[::2]])


def test_libcrypto_is_bound_and_its_calls_release_the_gil():
    """Linux images ship libcrypto 3 (Python's own ssl links it). A CDLL call drops the GIL;
    a PyDLL one (the Python API flag) would not."""
    evp = poly1305.evp_mac()
    assert evp is not None and poly1305.releases_gil()
    assert not evp.lib._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI
