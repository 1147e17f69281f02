"""ChaCha20 as an ember block cipher (``cipher="chacha20"``), on the CPU through OpenSSL.

ember counts its stream in 16-byte units; a 64-byte ChaCha20 block ``q`` supplies units
``4q .. 4q+3``. The ChaCha20 input words 12..15 hold ``q`` as a 128-bit little-endian integer (word
12 the lowest 32 bits), and the 256-bit ChaCha20 key is derived from ember's 16-byte key ``K`` as
``HMAC-SHA256(K, "ember.csprng/v1/chacha20-key")``. See docs/csprng-stream.md, "ChaCha20 blocks".

OpenSSL's ChaCha20 (via ``cryptography``) takes the 16-byte input words 12..15 as its "nonce" but
keeps only a 32-bit block counter, so the writer restarts it at every multiple of ``2**32`` blocks and
carries into words 13..15 itself.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms

from .ciphers import BLOCK_BYTES, register_cipher

CHACHA_BLOCK_BYTES = 64
UNITS_PER_BLOCK = CHACHA_BLOCK_BYTES // BLOCK_BYTES  # ember 16-byte units per ChaCha20 block
KEY_LABEL = b"ember.csprng/v1/chacha20-key"
_SEGMENT = 1 << 32  # ChaCha20 blocks one OpenSSL context can produce before its counter wraps
_ZEROS = memoryview(bytes(1 << 20))


def chacha_key(key: bytes) -> bytes:
    """The 32-byte ChaCha20 key used for ember's 16-byte key ``key``."""
    if len(key) != 16:
        raise ValueError(f"expected a 16-byte key, got {len(key)} bytes")
    return hmac.new(bytes(key), KEY_LABEL, hashlib.sha256).digest()


class ChaChaUnitWriter:
    """Writes ember units ``unit, unit + 1, ...`` of the ChaCha20 stream under a 32-byte key."""

    __slots__ = ("_key", "_unit", "_enc", "_left")

    def __init__(self, key32: bytes, unit: int) -> None:
        if len(key32) != 32:
            raise ValueError(f"expected a 32-byte ChaCha20 key, got {len(key32)} bytes")
        self._key = bytes(key32)
        self._unit = unit
        self._enc: CipherContext | None = None
        self._left = 0  # units the current context can still produce before its segment ends

    def _open(self) -> CipherContext:
        q, skip = divmod(self._unit, UNITS_PER_BLOCK)
        # words 12..15 = q (little-endian); OpenSSL increments only word 12, so stop at its wrap
        enc = Cipher(algorithms.ChaCha20(self._key, q.to_bytes(16, "little")),
                     mode=None).encryptor()
        self._left = (_SEGMENT - q % _SEGMENT) * UNITS_PER_BLOCK - skip
        if skip:
            enc.update(bytes(skip * BLOCK_BYTES))
        self._enc = enc
        return enc

    def fill(self, out: memoryview) -> None:
        """Write the next ``len(out) // 16`` units (``len(out)`` is a multiple of 16)."""
        n = len(out)
        if n % BLOCK_BYTES:
            raise ValueError(f"fill: expected a multiple of {BLOCK_BYTES} bytes, got {n}")
        off = 0
        enc = self._enc
        while off < n:
            if self._left == 0 or enc is None:
                enc = self._open()
            step = min(n - off, self._left * BLOCK_BYTES, len(_ZEROS))
            enc.update_into(_ZEROS[:step], out[off:off + step])
            off += step
            self._left -= step // BLOCK_BYTES
            self._unit += step // BLOCK_BYTES


class ChaCha20:
    """ChaCha20 (RFC 8439 block function) over ember's 128-bit counter of 16-byte units."""

    name = "chacha20"
    key_bytes = 16

    def keystream(self, key: bytes, counter: int) -> ChaChaUnitWriter:
        return ChaChaUnitWriter(chacha_key(key), counter)


register_cipher(ChaCha20())
