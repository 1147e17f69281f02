"""A streaming reader for POSIX tar archives (USTAR, GNU and PAX long names) that yields members.

It reads headers and data straight from a byte stream or a memory map, verifies header checksums,
and reports the byte offset of any corruption or truncation. Only regular files are yielded.
"""

from __future__ import annotations

import gzip
import io
import mmap
import os
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from ember.shards.errors import ShardError, TruncatedShardError

__all__ = ["iter_members", "scan_members", "open_tar_source", "memory_source", "BLOCK"]

BLOCK = 512
_ZERO = bytes(BLOCK)
_SPACES = b" " * 8
_CHUNK = 1 << 20
_REGULAR = (b"0", b"\x00", b"7")


class _MemorySource:
    """Reads a whole archive that is already addressable in memory (a memory-mapped file)."""

    def __init__(self, buf, url: str, closer=None):
        self.buf = buf
        self.end = len(buf)
        self.pos = 0
        self.url = url
        self._closer = closer

    def take(self, n: int) -> bytes:
        p = self.pos
        q = p + n
        if q > self.end:
            raise TruncatedShardError(
                f"archive ends inside a {n}-byte read ({self.end - p} bytes left)", self.url, p
            )
        self.pos = q
        return self.buf[p:q]

    def header(self) -> bytes | None:
        p = self.pos
        if p + BLOCK > self.end:
            if p == self.end:
                return None
            raise TruncatedShardError("archive ends inside a header block", self.url, p)
        self.pos = p + BLOCK
        return self.buf[p : p + BLOCK]

    def skip(self, n: int) -> None:
        if self.pos + n > self.end:
            raise TruncatedShardError("archive ends inside member data", self.url, self.pos)
        self.pos += n

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()


class _StreamSource:
    """Reads an archive from a sequential byte stream through a large buffer."""

    def __init__(self, stream: BinaryIO, url: str, closer=None):
        self.stream = stream
        self.url = url
        self.buf = b""
        self.bpos = 0
        self.pos = 0  # absolute offset of buf[bpos]
        self._closer = closer

    def _read(self, n: int) -> bytes:
        try:
            return self.stream.read(n)
        except ShardError:
            raise
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise ShardError(f"gzip stream is corrupt or truncated ({exc})", self.url, self.pos) from exc
        except OSError as exc:
            raise ShardError(f"read failed: {exc}", self.url, self.pos) from exc

    def take(self, n: int) -> bytes:
        b = self.bpos
        if b + n <= len(self.buf):
            self.bpos = b + n
            self.pos += n
            return self.buf[b : b + n]
        parts = [self.buf[b:]]
        have = len(parts[0])
        self.buf = b""
        self.bpos = 0
        while have < n:
            need = n - have
            chunk = self._read(max(need, _CHUNK) if need < _CHUNK else need)
            if not chunk:
                raise TruncatedShardError(
                    f"archive ends inside a {n}-byte read ({have} bytes left)", self.url, self.pos
                )
            if len(chunk) > need:
                parts.append(chunk[:need])
                self.buf = chunk
                self.bpos = need
                have = n
            else:
                parts.append(chunk)
                have += len(chunk)
        self.pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def header(self) -> bytes | None:
        if self.bpos == len(self.buf):
            chunk = self._read(_CHUNK)
            if not chunk:
                return None
            self.buf = chunk
            self.bpos = 0
        return self.take(BLOCK)

    def skip(self, n: int) -> None:
        avail = len(self.buf) - self.bpos
        if n <= avail:
            self.bpos += n
            self.pos += n
            return
        self.pos += avail
        n -= avail
        self.buf = b""
        self.bpos = 0
        while n > 0:
            chunk = self._read(min(n, _CHUNK))
            if not chunk:
                raise TruncatedShardError("archive ends inside member data", self.url, self.pos)
            self.pos += len(chunk)
            n -= len(chunk)

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()


def _is_regular_file(stream) -> bool:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False
    try:
        import stat

        return stat.S_ISREG(os.fstat(fd).st_mode) and stream.seekable()
    except OSError:
        return False


def open_tar_source(stream: BinaryIO, url: str):
    """Wrap an open byte stream for tar parsing; gzip is detected by its magic bytes.

    Regular local files are memory-mapped; anything else is read sequentially.
    """
    if _is_regular_file(stream):
        start = stream.tell()
        magic = stream.read(2)
        stream.seek(start)
        size = os.fstat(stream.fileno()).st_size - start
        if magic == b"\x1f\x8b":
            return _StreamSource(gzip.GzipFile(fileobj=stream, mode="rb"), url)
        if size <= 0:
            raise ShardError("empty file, not a tar archive", url, 0)
        if start == 0:
            mm = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
            return _MemorySource(mm, url, closer=mm.close)
        return _StreamSource(stream, url)
    first = stream.read(2)
    if not first:
        raise ShardError("empty stream, not a tar archive", url, 0)
    rest = _Prepend(first, stream)
    if first == b"\x1f\x8b":
        return _StreamSource(gzip.GzipFile(fileobj=rest, mode="rb"), url)
    return _StreamSource(rest, url)


class _Prepend(io.RawIOBase):
    """A stream that first returns some already-read bytes, then the rest of another stream."""

    def __init__(self, head: bytes, stream):
        self._head = head
        self._stream = stream

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if self._head:
            head, self._head = self._head, b""
            if n < 0:
                return head + self._stream.read()
            if n <= len(head):
                self._head = head[n:]
                return head[:n]
            return head + self._stream.read(n - len(head))
        return self._stream.read(n)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _checksum_ok(h: bytes) -> bool:
    field = h[148:156]
    try:
        stored = int(field.replace(b"\x00", b" ").strip() or b"-1", 8)
    except ValueError:
        return False
    # adler32's low half is 1 + (byte sum mod 65521): the unsigned sum checked at C speed.
    a = zlib.adler32(h[156:], zlib.adler32(_SPACES, zlib.adler32(h[:148])))
    if ((a & 0xFFFF) - 1) % 65521 == stored % 65521:
        return True
    # some old writers summed signed bytes
    signed = sum((x - 256 if x > 127 else x) for x in h[:148] + _SPACES + h[156:])
    return stored == signed


def _number(field: bytes, what: str, url: str, offset: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:
            value -= 1 << (8 * len(field) - 2)
        return value
    text = field.split(b"\x00", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise ShardError(f"header {what} field {field!r} is not an octal number", url, offset) from None


def _cstr(field: bytes) -> bytes:
    n = field.find(b"\x00")
    return field if n < 0 else field[:n]


def _decode_name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _parse_pax(data: bytes, url: str, offset: int) -> dict[str, bytes]:
    records: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:
            break
        sp = data.find(b" ", pos)
        try:
            length = int(data[pos:sp])
        except ValueError:
            raise ShardError("malformed PAX extended header record", url, offset) from None
        if sp < 0 or length <= 0 or pos + length > len(data) or data[pos + length - 1] != 10:
            raise ShardError("malformed PAX extended header record", url, offset)
        record = data[sp + 1 : pos + length - 1]
        eq = record.find(b"=")
        if eq < 0:
            raise ShardError("malformed PAX extended header record", url, offset)
        records[record[:eq].decode("utf-8", "replace")] = record[eq + 1 :]
        pos += length
    return records


def _members(src, url: str, with_data: bool, whole: bool = True
             ) -> Iterator[tuple[str, bytes | None, int, int]]:
    """Yield (name, data or None, start, end) for each regular file in the archive.

    ``start`` is the offset of the member's first record (long-name records included), ``end`` the
    offset just past its padded data. ``whole=False`` parses a slice of an archive that may stop at
    a member boundary without an end-of-archive marker.
    """
    long_name: bytes | None = None
    start: int | None = None
    pax: dict[str, bytes] = {}
    global_pax: dict[str, bytes] = {}
    take = src.take
    header = src.header
    skip = src.skip
    first = True
    while True:
        offset = src.pos
        h = header()
        if h is None:
            if not whole and long_name is None and not pax:
                return
            if first:
                raise ShardError("empty archive", url, 0)
            raise TruncatedShardError("archive ends without its end-of-archive marker", url, offset)
        first = False
        if h == _ZERO:
            # end-of-archive: a second zero block normally follows; EOF after one is tolerated
            second = src.pos
            h2 = header()
            if h2 is not None and h2 != _ZERO:
                raise ShardError("lone zero block in the middle of the archive", url, second)
            if long_name is not None or pax:
                raise TruncatedShardError("archive ends after a long-name record", url, offset)
            return
        if not _checksum_ok(h):
            raise ShardError("tar header checksum mismatch (corrupt archive)", url, offset)
        kind = h[156:157]
        size = _number(h[124:136], "size", url, offset)
        if size < 0:
            raise ShardError("negative member size", url, offset)
        padded = (size + 511) & ~511
        if kind in _REGULAR:
            if pax and "size" in pax:
                size = int(pax["size"])
                padded = (size + 511) & ~511
            if long_name is not None:
                name = _decode_name(long_name)
            elif "path" in pax:
                name = _decode_name(pax["path"])
            elif "path" in global_pax:
                name = _decode_name(global_pax["path"])
            else:
                raw = _cstr(h[0:100])
                if h[257:263] == b"ustar\x00":
                    prefix = _cstr(h[345:500])
                    if prefix:
                        raw = prefix + b"/" + raw
                name = _decode_name(raw)
            long_name = None
            if pax:
                pax = {}
            if start is not None:
                offset, start = start, None
            if with_data:
                data = take(size)
                if padded != size:
                    skip(padded - size)
                yield name, data, offset, src.pos
            else:
                skip(padded)
                yield name, None, offset, src.pos
        elif kind == b"L":
            long_name = _cstr(take(size))
            skip(padded - size)
            if start is None:
                start = offset
        elif kind == b"x":
            pax = _parse_pax(take(size), url, offset)
            skip(padded - size)
            if start is None:
                start = offset
        elif kind == b"g":
            global_pax.update(_parse_pax(take(size), url, offset))
            skip(padded - size)
        elif kind in (b"S", b"M"):
            raise ShardError(f"unsupported tar member type {kind!r} (sparse/multi-volume)", url, offset)
        else:
            # links, directories, devices, FIFOs and unknown types are not sample members
            long_name = None
            pax = {}
            start = None
            skip(padded)


def iter_members(source, url: str, *, whole: bool = True) -> Iterator[tuple[str, bytes, int]]:
    """Yield ``(name, data, offset)`` for every regular file of a tar source, in order.

    ``source`` comes from :func:`open_tar_source` (or :func:`memory_source`); ``offset`` is where
    the member's records start. Raises ShardError (with the offset) on a corrupt header and
    TruncatedShardError when the archive ends early.
    """
    for name, data, offset, _ in _members(source, url, True, whole):
        yield name, data, offset


def scan_members(source, url: str) -> Iterator[tuple[str, int, int]]:
    """Yield ``(name, start, end)`` byte spans of every regular file without keeping the data."""
    for name, _, start, end in _members(source, url, False):
        yield name, start, end


def memory_source(data: bytes, url: str) -> _MemorySource:
    """A tar source over bytes already in memory (for example one sample's span from an index)."""
    return _MemorySource(data, url)
