"""Counter-based stream state: a key, a 128-bit block counter and the reservation of block ranges.

Every draw reserves a contiguous range of whole blocks under a lock and then generates it outside the
lock, so concurrent threads never share a block and the position after any sequence of draws depends
only on the sizes drawn. Keys of substreams (``fold_in``, ``spawn``, rejection refills) are derived
with HMAC-SHA256 (see docs/csprng-stream.md for the exact labels).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import weakref

from .ciphers import BLOCK_BYTES, COUNTER_LIMIT, BlockCipher, KeystreamWriter, get_cipher

KEY_BYTES = 16
_LABEL_PREFIX = b"ember.csprng/v1/"


def derive_key(key: bytes, label: str, index: int) -> bytes:
    """The 16-byte key of substream ``index`` under ``label``:
    HMAC-SHA256(key, "ember.csprng/v1/" || label || 0x00 || LE128(index))[:16]."""
    if not 0 <= index < 1 << 128:
        raise ValueError(f"substream index must be in [0, 2**128), got {index}")
    msg = _LABEL_PREFIX + label.encode() + b"\x00" + index.to_bytes(16, "little")
    return hmac.new(key, msg, hashlib.sha256).digest()[:KEY_BYTES]


def key_from_seed(seed: int) -> bytes:
    """The key of ``create_generator(seed)``: SHA-256("ember.csprng/v1/seed" || 0 || LE128(seed))[:16]."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 1 << 128:
        raise ValueError(f"seed must be in [0, 2**128), got {seed}")
    msg = _LABEL_PREFIX + b"seed\x00" + seed.to_bytes(16, "little")
    return hashlib.sha256(msg).digest()[:KEY_BYTES]


def check_key(key: bytes | bytearray | memoryview) -> bytes:
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"expected a {KEY_BYTES}-byte key, got {len(key)} bytes")
    return key


class CounterExhausted(OverflowError):
    """Raised when a draw would pass the end of the 2**128-block counter space."""


def _exhausted(start: int, nblocks: int) -> CounterExhausted:
    return CounterExhausted(
        f"ember.csprng: drawing {nblocks} blocks would pass the end of the 2**128 counter space "
        f"(at {start}); re-key the generator (manual_seed/seed) or use fold_in/spawn for a fresh "
        "stream")


class BlockStream:
    """Key, counter and lock of one stream; hands out keystream for reserved block ranges."""

    __slots__ = ("_key", "_counter", "_lock", "_cipher", "_cached", "__weakref__")

    def __init__(self, key: bytes, counter: int = 0, cipher: str = "aes128") -> None:
        self._key = check_key(key)
        if not 0 <= counter <= COUNTER_LIMIT:
            raise ValueError(f"counter must be in [0, 2**128], got {counter}")
        self._counter = counter
        self._cipher: BlockCipher = get_cipher(cipher)
        self._lock = threading.Lock()
        renew_lock_after_fork(self)
        # (position, writer): a writer whose next block is `position`; reused by the next draw that
        # starts there, which saves creating an OpenSSL context (~8 us) on sequential draws.
        self._cached: tuple[int, KeystreamWriter] | None = None

    @property
    def key(self) -> bytes:
        return self._key

    @property
    def counter(self) -> int:
        return self._counter

    @property
    def cipher_name(self) -> str:
        return self._cipher.name

    def reset(self, key: bytes, counter: int = 0) -> None:
        with self._lock:
            self._key = check_key(key)
            self._counter = counter
            self._cached = None

    def _advance(self, nblocks: int) -> int:
        """Move the counter past ``nblocks`` blocks and return where it was (lock held)."""
        start = self._counter
        if start + nblocks > COUNTER_LIMIT:
            raise _exhausted(start, nblocks)
        self._counter = start + nblocks
        return start

    def _writer(self, start: int, cached: tuple[int, KeystreamWriter] | None) -> KeystreamWriter:
        """``cached``'s writer if it stands at block ``start``, else a new one there."""
        if cached is not None and cached[0] == start:
            return cached[1]
        return self._cipher.keystream(self._key, start)

    def reserve(self, nblocks: int) -> int:
        """Reserve ``nblocks`` consecutive blocks and return the first block's counter."""
        with self._lock:
            return self._advance(nblocks)

    def keystream(self, start: int) -> KeystreamWriter:
        """A writer positioned at block ``start`` (reusing the cached one when it is there)."""
        with self._lock:
            cached, self._cached = self._cached, None
        return self._writer(start, cached)

    def give_back(self, position: int, writer: KeystreamWriter) -> None:
        """Offer a writer now positioned at block ``position`` for reuse by the next draw."""
        with self._lock:
            if self._counter == position:
                self._cached = (position, writer)

    def take(self, nblocks: int) -> tuple[int, bytearray]:
        """Reserve ``nblocks`` blocks and return (first block, their keystream): for small draws."""
        with self._lock:  # reserve() and keystream() under one acquisition
            start = self._advance(nblocks)
            cached, self._cached = self._cached, None
        # self._writer(start, cached), inlined: this runs once per small draw
        writer = cached[1] if cached is not None and cached[0] == start else \
            self._cipher.keystream(self._key, start)
        buf = bytearray(nblocks * BLOCK_BYTES)
        writer.fill(memoryview(buf))
        self.give_back(start + nblocks, writer)
        return start, buf

    def draw(self, nblocks: int) -> Draw:
        """Reserve ``nblocks`` blocks and return the object that writes their keystream."""
        start = self.reserve(nblocks)
        return Draw(self, start, nblocks)


class Draw:
    """One reserved block range ``[start, start + nblocks)`` of a stream.

    ``fill(buf)`` writes the next ``len(buf)`` keystream bytes of the range (a multiple of 16 except
    for the last call); ``refill_stream()`` gives the stream used to replace rejected values, keyed
    by the draw's start so that it is a pure function of (key, start).
    """

    __slots__ = ("stream", "start", "nblocks", "_writer", "_written")

    def __init__(self, stream: BlockStream, start: int, nblocks: int) -> None:
        self.stream = stream
        self.start = start
        self.nblocks = nblocks
        self._writer: KeystreamWriter | None = None
        self._written = 0

    def fill(self, buf: memoryview) -> None:
        n = len(buf)
        if n == 0:
            return
        if self._writer is None:
            self._writer = self.stream.keystream(self.start)
        total = self.nblocks * BLOCK_BYTES
        if self._written + n > total:
            raise RuntimeError("internal error: draw wrote past its reserved blocks")
        whole = n - n % BLOCK_BYTES
        if whole:
            self._writer.fill(buf[:whole])
        if whole != n:
            tail = bytearray(BLOCK_BYTES)
            self._writer.fill(memoryview(tail))
            buf[whole:] = tail[: n - whole]
            n = whole + BLOCK_BYTES
        self._written += n
        if self._written == total:
            self.stream.give_back(self.start + self.nblocks, self._writer)

    def part(self, first_block: int, nblocks: int) -> Draw:
        """The sub-range of this draw starting ``first_block`` blocks in (for parallel filling)."""
        if first_block < 0 or first_block + nblocks > self.nblocks:
            raise ValueError("internal error: part outside the reserved blocks")
        return Draw(self.stream, self.start + first_block, nblocks)

    def refill_stream(self) -> BlockStream:
        return BlockStream(derive_key(self.stream.key, "reject", self.start), 0,
                           self.stream.cipher_name)


# Objects whose ``_lock`` a forked child replaces: another thread of the parent may have held it
# at the fork, and that thread does not exist in the child to release it.
_FORK_LOCKS: weakref.WeakSet = weakref.WeakSet()


def renew_lock_after_fork(obj: object) -> None:
    """Give ``obj`` a new, unlocked ``_lock`` in every forked child."""
    _FORK_LOCKS.add(obj)


# Streams keyed from the operating system that must be re-keyed in a forked child.
_FORK_REKEY: weakref.WeakSet = weakref.WeakSet()


def rekey_after_fork(stream: BlockStream) -> None:
    """Register ``stream`` to receive a fresh OS key (and counter 0) in every forked child."""
    _FORK_REKEY.add(stream)


def forget_fork_rekey(stream: BlockStream) -> None:
    _FORK_REKEY.discard(stream)


def _after_fork_in_child() -> None:
    for obj in list(_FORK_LOCKS):
        obj._lock = threading.Lock()
    for stream in list(_FORK_REKEY):
        stream.reset(os.urandom(KEY_BYTES), 0)


if hasattr(os, "register_at_fork"):  # POSIX only; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
