"""A local cache of remote shards (``cache_dir=``): the first read of a shard stores a copy, later
reads open the copy.

A shard is written to a temporary file of its own (unique name, created exclusively) while it is
being read, and renamed to its final name only once the tar parser reached the end of the archive
without an error (the reader calls :meth:`CachedReader.complete`); a failed, cut-short, garbage or
abandoned read removes the temporary file instead. Several workers and ranks may cache the same
shard at once: each writes its own temporary file and the renames are atomic, so a reader only
ever sees complete copies. The cache is bounded by ``cache_size`` bytes: after each new copy the
least recently used copies are removed until the rest fits. Portable: no file locks are needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, cast

__all__ = ["cache_path", "open_cached", "CachingStream", "CachedReader", "evict"]

PART = ".part"
DRAIN_LIMIT = 1 << 20  # bytes still read after the end of the archive (padding) to complete a copy
STALE_PART_SECONDS = 3600.0


def cache_path(cache_dir: str | os.PathLike, url: str) -> Path:
    """Where the copy of ``url`` lives: a hash of the whole URL and its readable last part."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:20]
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
    return Path(cache_dir) / f"{digest}-{tail}"


def open_cached(path: Path) -> BinaryIO | None:
    """The cached copy at ``path`` opened for reading (marked as just used), or None."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except OSError:
        return None
    with contextlib.suppress(OSError):  # another process may be evicting it: f still reads it
        os.utime(path)
    return f


class CachingStream(io.RawIOBase):
    """Reads ``remote`` and writes what it reads to a temporary file, renamed to ``final`` by
    :meth:`complete` (after reading up to ``DRAIN_LIMIT`` bytes that follow, to the end of
    ``remote``); removed on any error, and at a close without :meth:`complete`."""

    def __init__(self, remote: BinaryIO, final: Path, cache_size: int | None):
        super().__init__()
        self.remote = cast(io.RawIOBase, remote)  # a raw stream: it has readinto
        self.final = final
        self.cache_size = cache_size
        self._tmp: Path | None = None
        self._file: BinaryIO | None = None
        self._ended = False  # the end of remote was reached
        self._done = False  # the copy was kept or discarded

    def readable(self) -> bool:
        return True

    def _write(self, data) -> None:
        if self._file is None:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=self.final.parent, prefix=self.final.name + ".",
                                        suffix=PART)  # O_EXCL: a name no one else uses
            self._tmp = Path(name)
            self._file = os.fdopen(fd, "wb")
        self._file.write(data)

    def readinto(self, b) -> int:
        if self._ended:
            return 0
        try:
            n = self.remote.readinto(b)
            if n:
                if not self._done:
                    self._write(memoryview(b)[:n])
            else:
                self._ended = True
            return n
        except BaseException:
            self._discard()
            raise

    def complete(self) -> None:
        """The shard read so far is whole and valid: read on to the end of ``remote`` (at most
        ``DRAIN_LIMIT`` bytes) and keep the copy; discard it if the end is not reached."""
        if self._done:
            return
        buf = bytearray(1 << 16)
        left = DRAIN_LIMIT
        try:
            while left > 0 and not self._ended:
                left -= self.readinto(buf)
        except Exception:
            return  # _discard already ran: nothing partial stays
        if not self._ended:
            self._discard()  # more follows the archive than padding: not a copy of a shard
            return
        self._keep()

    def _keep(self) -> None:
        self._done = True
        if self._file is None:
            self._write(b"")
        assert self._file is not None and self._tmp is not None
        self._file.close()
        size = self._tmp.stat().st_size
        if self.cache_size is not None and size > self.cache_size:
            self._discard()  # larger than the whole cache: not kept
            return
        try:
            os.replace(self._tmp, self.final)
        except OSError:
            self._discard()  # e.g. Windows, the final copy open elsewhere: that copy is complete
            return
        self._tmp = None
        if self.cache_size is not None:
            evict(self.final.parent, self.cache_size, keep=self.final)

    def _discard(self) -> None:
        self._done = True
        if self._file is not None:
            self._file.close()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._discard()  # a no-op after complete()
        finally:
            self.remote.close()
            super().close()


class CachedReader(io.BufferedReader):
    """A buffered :class:`CachingStream`; :meth:`complete` keeps the copy."""

    def complete(self) -> None:
        """Called by the reader once the tar parser reached the archive's end without an error."""
        raw = self.raw
        if isinstance(raw, CachingStream):
            raw.complete()


def evict(cache_dir: Path, cache_size: int, keep: Path | None = None) -> None:
    """Remove least recently used copies until those left take at most ``cache_size`` bytes
    (never ``keep``); also removes temporary files left by killed processes."""
    entries = []
    now = time.time()
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return
    for name in names:
        path = Path(cache_dir) / name
        try:
            st = path.stat()
        except OSError:
            continue
        if name.endswith(PART):
            if now - st.st_mtime > STALE_PART_SECONDS:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            continue
        entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= cache_size:
            break
        if keep is not None and path == keep:
            continue
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass  # open elsewhere (Windows) or already gone
