"""ChaCha20 unit stream: RFC 8439 2.4.2 vector and pycryptodome across the 2**32 and 2**64 carries."""

from __future__ import annotations

import os

import pytest

from ember.csprng.chacha import ChaChaUnitWriter

RFC_KEY = bytes(range(32))
RFC_PLAIN = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
             b"the future, sunscreen would be it.")


def _pycryptodome(key32: bytes, unit: int, nunits: int) -> bytes:
    from Crypto.Cipher import ChaCha20

    q, skip = divmod(unit, 4)
    out = b""
    while len(out) < (nunits + skip) * 16:
        c = ChaCha20.new(key=key32, nonce=(q >> 64).to_bytes(8, "little"))
        c.seek((q % 2**64) * 64)
        m = min(2**64 - q % 2**64, 64)
        out += c.encrypt(bytes(m * 64))
        q += m
    return out[skip * 16:(skip + nunits) * 16]


def test_rfc8439_2_4_2_matches_pycryptodome_12_byte_nonce():
    from Crypto.Cipher import ChaCha20

    nonce = bytes.fromhex("000000000000004a00000000")
    q = int.from_bytes((1).to_bytes(4, "little") + nonce, "little")  # words 12..15
    w = ChaChaUnitWriter(RFC_KEY, 4 * q)
    ks = bytearray(128)
    w.fill(memoryview(ks))
    ct = bytes(a ^ b for a, b in zip(RFC_PLAIN, ks, strict=False))
    ref = ChaCha20.new(key=RFC_KEY, nonce=nonce)
    ref.seek(64)
    assert ct == ref.encrypt(RFC_PLAIN)
    assert ct[:16].hex() == "6e2e359a2568f98041ba0728dd0d6981"


@pytest.mark.parametrize("unit", [0, 5, 4 * (2**32 - 2) + 1, 4 * (2**64 - 1) + 3])
def test_units_match_pycryptodome_across_counter_carries(unit):
    key = os.urandom(32)
    w = ChaChaUnitWriter(key, unit)
    b = bytearray(16 * 40)
    w.fill(memoryview(b)[:48])
    w.fill(memoryview(b)[48:])
    assert bytes(b) == _pycryptodome(key, unit, 40)
