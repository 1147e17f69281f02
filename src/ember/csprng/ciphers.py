"""Block sources: keystream for a range of 128-bit counter blocks.

The seam every backend implements: ``keystream(key, counter)`` returns a writer whose successive
``fill(out)`` calls write the keystream of blocks ``counter, counter + 1, ...`` into ``out`` (a
writable buffer whose length is a multiple of 16). On CPU, AES-128 comes from OpenSSL through the
``cryptography`` package; block ``i`` is ``AES-128_key(BE128(i))``, i.e. standard CTR mode with the
whole 16-byte counter block as a big-endian integer.
"""

from __future__ import annotations

from typing import Protocol

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

BLOCK_BYTES = 16
COUNTER_LIMIT = 1 << 128  # counters are 128-bit; a draw past this raises instead of wrapping

# Plaintext for CTR mode: the keystream is the encryption of zeros. Shared, never written.
_ZEROS = memoryview(bytes(1 << 20))


class KeystreamWriter(Protocol):
    def fill(self, out: memoryview) -> None: ...


class BlockCipher(Protocol):
    name: str

    def keystream(self, key: bytes, counter: int) -> KeystreamWriter: ...


class _OpenSSLCTRWriter:
    """Sequential keystream writer over one OpenSSL CTR context."""

    __slots__ = ("_enc",)

    def __init__(self, algorithm: algorithms.CipherAlgorithm, nonce: bytes) -> None:
        self._enc = Cipher(algorithm, modes.CTR(nonce)).encryptor()

    def fill(self, out: memoryview) -> None:
        n = len(out)
        zeros = _ZEROS
        if n <= len(zeros):  # the common case: one OpenSSL call
            self._enc.update_into(zeros[:n], out)
            return
        off = 0
        while off < n:
            step = min(n - off, len(zeros))
            self._enc.update_into(zeros[:step], out[off : off + step])
            off += step


class AES128:
    """AES-128 in counter mode (the native ember stream cipher)."""

    name = "aes128"
    key_bytes = 16

    def keystream(self, key: bytes, counter: int) -> KeystreamWriter:
        return _OpenSSLCTRWriter(algorithms.AES(key), counter.to_bytes(16, "big"))


_CIPHERS: dict[str, BlockCipher] = {"aes128": AES128()}


def register_cipher(cipher: BlockCipher) -> None:
    """Make ``cipher`` available by its ``name`` (used by the ChaCha20 and GPU backends)."""
    _CIPHERS[cipher.name] = cipher


def get_cipher(name: str) -> BlockCipher:
    try:
        return _CIPHERS[name]
    except KeyError:
        raise ValueError(
            f"unknown cipher {name!r}; expected one of {sorted(_CIPHERS)}"
        ) from None


def cipher_names() -> list[str]:
    return sorted(_CIPHERS)
