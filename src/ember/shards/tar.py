"""A streaming reader for POSIX tar archives (USTAR, GNU and PAX long names) that yields members.

It reads headers and data straight from a memory map or, for other byte streams, through large
chunks, verifies header checksums, and reports the byte offset of any corruption or truncation.
Only regular files are yielded.

Where an archive may end: only after its end-of-archive zero block(s) (a single one is
tolerated). Ending anywhere else raises TruncatedShardError naming the offset where the bytes ran
out, after every member that is complete before that point: inside a header, member data or
padding, right after a long-name record, and also right after a complete member with no
end-of-archive blocks. GNU tar accepts that last case, but a shard cut at a member boundary looks
exactly like it and the sample in progress may have lost members, so a reader must not treat it
as a clean end. A gzip stream that ends before its end-of-stream marker is truncated for the same
reason, wherever the cut falls, in the tar stream or after it: a reader calls the source's
``finish()`` after the last member, which reads the gzip stream to the end of its last member and
checks its trailer (CRC-32 and length).
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from typing import BinaryIO, NamedTuple, cast

from ember.shards.errors import ShardError, TruncatedShardError

try:  # the common case of header parsing, compiled (setup.py); None where it was not built
    from ember.shards._speedups import scan as _scan
except ImportError:  # pragma: no cover - depends on the build
    _scan = None

__all__ = ["iter_members", "scan_members", "open_tar_source", "memory_source", "BLOCK"]

BLOCK = 512
_ZERO = bytes(BLOCK)
_CHUNK = 1 << 20
_LARGE = 1 << 26  # the most bytes asked of a stream at once
_GZ_INPUT = 1 << 18  # compressed bytes per read, small enough to keep zlib's leftovers cheap
_CACHE = 4096  # entries per field-value cache
# members per call of the compiled scanner, and its data bytes per call: what it parses ahead of
# the consumer
_SCAN_COUNT = 64
_SCAN_BYTES = 64 << 10
# name, size, chksum and typeflag: the only fields a reader of regular files needs
_HEADER = struct.Struct("100s24x12s12x8sB")
_USTAR = b"ustar\x00"
_REGULAR = (ord("0"), 0, ord("7"))
_LONGNAME, _PAX, _GLOBAL_PAX = ord("L"), ord("x"), ord("g")
_EXTENDED = (_LONGNAME, _PAX, _GLOBAL_PAX)
_LONGLINK = ord("K")  # a GNU long link target: only links have one
_UNSUPPORTED = (ord("S"), ord("M"))
_LINKS = (ord("1"), ord("2"))  # a hard link, a symbolic link


class Link(NamedTuple):
    """A link member of a tar stream (from :func:`iter_members` with ``links=True``): ``target``
    is the name it points to, ``hard`` tells a hard link (to an earlier member) from a symlink."""

    target: str
    hard: bool


class _MemorySource:
    """An archive that is addressable in memory as a whole (a memory-mapped file, bytes)."""

    def __init__(self, buf, url: str, closer=None):
        self.buf = buf
        self.base = 0  # absolute offset of buf[0]
        self.end = len(buf)
        self.url = url
        self._closer = closer

    def refill(self, pos: int, need: int) -> int:
        """Make ``need`` bytes from window offset ``pos`` available; return their new offset
        (here everything already is in the window)."""
        return pos

    def truncated(self, what: str, at: int) -> TruncatedShardError:
        return TruncatedShardError(f"archive ends {what}", self.url, at)

    def finish(self) -> None:
        """Check what follows the archive's end (called once its members were read without
        an error): nothing to check in memory."""

    def take(self, start: int, size: int, padded: int, with_data: bool, what: str) -> bytes | None:
        """Consume a member's padded data that runs past the window: here, always truncation."""
        if start + size > self.end:
            raise self.truncated(f"inside the data of {what}", self.end)
        raise self.truncated(f"inside the padding after {what}", self.end)

    def close(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()


class _StreamSource:
    """An archive read sequentially from a byte stream, one large chunk (the window) at a time.

    ``buf`` holds the stream's bytes from absolute offset ``base``; members inside the window are
    sliced out of it (one copy), members that run past it are read straight from the stream.
    """

    def __init__(self, stream, url: str, head: bytes = b""):
        self.stream = stream
        self.url = url
        self.buf = head
        self.base = 0
        self.end = len(head)

    def _read(self, n: int) -> bytes:
        try:
            return self.stream.read(min(n, _LARGE))
        except ShardError:
            raise
        except OSError as exc:
            raise ShardError(f"read failed: {exc}", self.url, self.base + self.end) from exc

    def _read_exact(self, n: int) -> bytes:
        """Up to ``n`` bytes: fewer only at the end of the stream.

        At most ``_LARGE`` bytes are asked for at once, so a size read from a damaged header
        costs memory only for the bytes that really follow; a size that no memory holds is a
        ShardError.
        """
        data = self._read(n)
        if len(data) >= n or not data:
            return data
        parts = [data]
        have = len(data)
        try:
            while have < n:
                chunk = self._read(n - have)
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
            return b"".join(parts)
        except MemoryError:
            parts.clear()
            raise ShardError(f"a member of {n} bytes does not fit in memory", self.url,
                             self.base + self.end) from None

    def refill(self, pos: int, need: int) -> int:
        """Start the window at ``pos`` holding at least ``need`` bytes, or all that is left;
        return the new offset of those bytes (0)."""
        tail = self.buf[pos : self.end]
        base = self.base + pos
        if tail:
            # complete what straddles the chunk boundary with a small read, so the next chunk
            # is read whole into a fresh window instead of being copied behind the tail
            buf = tail + self._read_exact(need - len(tail)) if len(tail) < need else tail
        else:
            buf = self._read(max(need, _CHUNK))
            if 0 < len(buf) < need:
                buf += self._read_exact(need - len(buf))
        self.buf, self.base, self.end = buf, base, len(buf)
        return 0

    def take(self, start: int, size: int, padded: int, with_data: bool, what: str) -> bytes | None:
        """Consume ``padded`` bytes from window offset ``start``; return the first ``size``.

        Afterwards the window is empty and starts right after the padding.
        """
        have = self.end - start
        at = self.base + start
        data = None
        if with_data:
            if have >= size:
                data = self.buf[start : start + size]
            else:
                rest = self._read_exact(size - have)
                if have + len(rest) < size:
                    raise self.truncated(f"inside the data of {what}", at + have + len(rest))
                data = self.buf[start : self.end] + rest if have else rest
                have = size
        left = padded - have
        while left > 0:
            chunk = self._read(min(left, _CHUNK))
            if not chunk:
                inside = "padding after" if padded - left >= size else "data of"
                raise self.truncated(f"inside the {inside} {what}", at + padded - left)
            left -= len(chunk)
        self.buf, self.base, self.end = b"", at + padded, 0
        return data

    def finish(self) -> None:
        """Check what follows the archive's end (called once its members were read without
        an error): a gzip stream is read to the end of its last member, so its trailer (CRC-32
        and length) is checked, once per shard; a TruncatedShardError if it is cut short."""
        if isinstance(self.stream, _Gunzip):
            self.stream.read_to_end()

    def truncated(self, what: str, at: int) -> TruncatedShardError:
        why = getattr(self.stream, "truncated", None)
        return TruncatedShardError(f"archive ends {what}" + (f"; {why}" if why else ""), self.url, at)

    def close(self) -> None:
        self.buf = b""  # the caller closes the stream


class _Gunzip:
    """Decompresses a gzip stream (concatenated members and zero padding allowed) on read().

    A stream that ends before a member's end-of-stream marker reads as the end of the data, with
    ``truncated`` saying so: the tar reader then decides whether anything was lost (nothing is,
    if the cut falls after the end-of-archive blocks).
    """

    def __init__(self, raw, url: str, head: bytes = b""):
        self.raw = raw
        self.url = url
        self._d = zlib.decompressobj(31)
        self._input = head
        self._block = b""  # the last decompressed block, returned from self._at on
        self._at = 0
        self._out = 0  # uncompressed bytes decompressed so far
        self.truncated: str | None = None

    def _raw_read(self) -> bytes:
        try:
            return self.raw.read(_GZ_INPUT)
        except ShardError:
            raise
        except OSError as exc:
            raise ShardError(f"read failed: {exc}", self.url, self._out) from exc

    def _inflate(self) -> bytes:
        """The next block of uncompressed data (at most _CHUNK bytes), or b"" at the end."""
        while True:
            d = self._d
            if self._input:
                inp, self._input = self._input, b""
            elif d.eof:
                # another gzip member may follow; zero bytes after the last one are padding
                rest = d.unused_data.lstrip(b"\x00")
                while not rest:
                    chunk = self._raw_read()
                    if not chunk:
                        return b""
                    rest = chunk.lstrip(b"\x00")
                self._d = d = zlib.decompressobj(31)
                inp = rest
            elif d.unconsumed_tail:
                inp = d.unconsumed_tail
            else:
                inp = self._raw_read()
                if not inp:
                    self.truncated = "the gzip stream ends before its end-of-stream marker"
                    return b""
            try:
                out = d.decompress(inp, _CHUNK)
            except zlib.error as exc:
                raise ShardError(f"gzip stream is corrupt ({exc})", self.url, self._out) from exc
            if out:
                self._out += len(out)
                return out

    def read_to_end(self) -> None:
        """Decompress the rest of the stream (what follows the tar's end: padding, zero bytes)
        through the trailer of its last member, which zlib checks (a ShardError if the CRC-32
        or length is wrong); a TruncatedShardError if the stream ends before that trailer."""
        self._block, self._at = b"", 0
        while self._inflate():
            pass
        if self.truncated:
            raise TruncatedShardError("the gzip stream ends before its trailer (CRC-32 and "
                                      "length), after the tar's end-of-archive blocks",
                                      self.url, self._out)

    def read(self, n: int) -> bytes:
        at = self._at
        block = self._block
        if at >= len(block):
            block, at = self._inflate(), 0
            if at + n >= len(block):
                self._block, self._at = b"", 0
                return block
            self._block = block
        self._at = at + n
        return block[at : at + n]


def _is_regular_file(stream) -> bool:
    try:
        fd = stream.fileno()
        return stat.S_ISREG(os.fstat(fd).st_mode) and stream.seekable()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return False


def open_tar_source(stream: BinaryIO, url: str):
    """Wrap an open byte stream for tar parsing; gzip is detected by its magic bytes.

    A regular local file read from its start is memory-mapped (copying a member out of the map
    is faster than reading it, measured against os.pread and buffered reads); anything else is
    read sequentially. The caller still closes ``stream``; closing the source releases the map.
    """
    if _is_regular_file(stream) and stream.tell() == 0:
        size = os.fstat(stream.fileno()).st_size
        if size == 0:
            raise ShardError("empty file, not a tar archive", url, 0)
        if stream.read(2) == b"\x1f\x8b":
            stream.seek(0)
            return _StreamSource(_Gunzip(stream, url), url)
        mm = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
        return _MemorySource(mm, url, closer=mm.close)
    first = stream.read(2)
    if len(first) == 1:  # a raw stream may return less than asked for
        first += stream.read(1)
    if not first:
        raise ShardError("empty stream, not a tar archive", url, 0)
    if first == b"\x1f\x8b":
        return _StreamSource(_Gunzip(stream, url, head=first), url)
    return _StreamSource(stream, url, head=first)


def _stored_checksum(field: bytes) -> int | None:
    try:
        return int(field.partition(b"\x00")[0], 8)
    except ValueError:
        return None


def _expected_adler(field: bytes) -> int:
    """The low half of zlib.adler32 of a header block whose checksum field is ``field``.

    adler32's low half is 1 + (byte sum mod 65521): the unsigned byte sum at C speed. The stored
    checksum is the sum with the field itself read as 8 spaces (8 * 32 = 256).
    """
    stored = _stored_checksum(field)
    if stored is None:
        return -1
    return 1 + (stored - 256 + sum(field)) % 65521


def _signed_checksum_ok(h: bytes, field: bytes) -> bool:
    """Whether the header checks out under the signed-byte sum some old writers used."""
    stored = _stored_checksum(field)
    return stored == sum((x - 256 if x > 127 else x) for x in h[:148] + b" " * 8 + h[156:])


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


def _ustar_name(h: bytes, name: bytes) -> bytes:
    """The full name of a USTAR header whose prefix field is in use."""
    if h[257:263] != _USTAR:
        return name  # GNU headers keep other data in that area
    prefix = h[345:500].partition(b"\x00")[0]
    return prefix + b"/" + name if prefix else name


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


class _Extended:
    """GNU long-name and PAX records read so far, which apply to the next member."""

    def __init__(self):
        self.long_name: bytes | None = None
        self.long_link: bytes | None = None  # a GNU long link target
        self.pax: dict[str, bytes] | None = None
        self.start: int | None = None  # offset of the first such record
        self.global_path: bytes | None = None
        self.pending = False  # whether the next member's name or size may come from here

    def add(self, kind: int, payload: bytes, url: str, offset: int) -> None:
        if kind == _GLOBAL_PAX:
            self.global_path = _parse_pax(payload, url, offset).get("path", self.global_path)
        else:
            if kind == _LONGNAME:
                self.long_name = payload.partition(b"\x00")[0]
            elif kind == _LONGLINK:
                self.long_link = payload.partition(b"\x00")[0]
            else:
                self.pax = _parse_pax(payload, url, offset)
            if self.start is None:
                self.start = offset
        self.pending = True

    def waiting(self) -> bool:
        """Whether records were read that no member has used yet."""
        return self.long_name is not None or self.long_link is not None or self.pax is not None

    def apply(self, offset: int, size: int, url: str) -> tuple[bytes | None, int, int]:
        """(name or None for the header's own, offset of the first record, size) of the member
        whose header is at ``offset``."""
        raw = self.long_name
        if self.pax is not None:
            if "size" in self.pax:
                text = self.pax["size"]
                if not text.isdigit():
                    raise ShardError(f"PAX size {text!r} is not a number", url, offset)
                size = int(text)
            if raw is None:
                raw = self.pax.get("path")
        if raw is None:
            raw = self.global_path
        if self.start is not None:
            offset = self.start
        self.drop()
        return raw, offset, size

    def drop(self) -> None:
        self.long_name = self.long_link = self.pax = self.start = None
        self.pending = self.global_path is not None


def _check_end(src, pos: int, ext: _Extended, whole: bool, first: bool) -> None:
    """Raise unless the data ending at window offset ``pos`` (less than a block left) is a
    clean end of the archive, or with ``whole=False`` of a slice of one."""
    part = src.buf[pos : src.end]
    at = src.base + pos
    if part and part.count(0) != len(part):
        raise src.truncated(f"{len(part)} bytes into the header block at byte {at}", at + len(part))
    if ext.waiting():
        raise src.truncated("right after a long-name or PAX record", at + len(part))
    if part or not whole:
        return  # a cut inside the end-of-archive blocks loses no member
    if first:
        raise ShardError("empty archive", src.url, 0)
    # GNU tar reads on here, but a shard cut at a member boundary looks just like this, and its
    # last sample may have lost members: the caller must not take it as complete
    raise src.truncated(
        "without its end-of-archive blocks, right after a complete member (the "
        "last sample may be incomplete)",
        at,
    )


def _end_of_archive(src, pos: int, ext: _Extended) -> None:
    """Check what follows the zero block at window offset ``pos``: a second one, or nothing."""
    at = src.refill(pos + BLOCK, BLOCK)
    following = src.buf[at : min(at + BLOCK, src.end)]
    if following.count(0) != len(following):
        raise ShardError("lone zero block in the middle of the archive", src.url, src.base + at)
    if ext.waiting():
        raise src.truncated("right after a long-name or PAX record", src.base + at - BLOCK)


def _header_ok(h: bytes, chk_f: bytes, sums: dict[bytes, int]) -> bool:
    """Whether the checksum of header ``h`` (whose checksum field is ``chk_f``) holds, by the
    unsigned or the old signed byte sum; ``sums`` caches expected values per field."""
    want = sums.get(chk_f)
    if want is None:
        if len(sums) >= _CACHE:
            sums.clear()
        want = sums[chk_f] = _expected_adler(chk_f)
    return zlib.adler32(h) & 0xFFFF == want or _signed_checksum_ok(h, chk_f)


def _member_size(size_f: bytes, sizes: dict[bytes, int], url: str, at: int) -> int:
    """The size field's value (cached per field), refused when negative."""
    size = sizes.get(size_f)
    if size is None:
        if len(sizes) >= _CACHE:
            sizes.clear()
        size = sizes[size_f] = _number(size_f, "size", url, at)
        if size < 0:
            raise ShardError("negative member size", url, at)
    return size


def _member_name(h: bytes, name: bytes, ext: _Extended, offset: int, size: int,
                 url: str) -> tuple[str, int, int]:
    """(name, offset of its first record, size) of the regular member whose header ``h`` is at
    ``offset``, with the long-name and PAX records read before it applied."""
    raw = None
    if ext.pending:
        raw, offset, size = ext.apply(offset, size, url)
    if raw is None:
        raw = name.partition(b"\x00")[0]
        if h[345]:
            raw = _ustar_name(h, raw)
    return raw.decode("utf-8", "surrogateescape"), offset, size


def _other_record(src, pos: int, kind: int, size: int, ext: _Extended, url: str) -> int:
    """Consume a record that is not a regular member (long-name and PAX records are kept in
    ``ext``; links, folders, devices and unknown types are skipped); return the window offset
    after it."""
    record_at = src.base + pos
    if kind in _UNSUPPORTED:
        raise ShardError(f"unsupported tar member type {chr(kind)!r} (sparse/multi-volume)", url,
                         record_at)
    data_at = pos + BLOCK
    padded = (size + 511) & ~511
    keep = kind in _EXTENDED or kind == _LONGLINK
    if data_at + padded <= src.end:
        payload = src.buf[data_at : data_at + size] if keep else None
        pos = data_at + padded
    else:
        what = f"the {chr(kind)!r} record at byte {record_at}"
        payload = src.take(data_at, size, padded, keep, what)
        pos = 0
    if keep:
        ext.add(kind, cast(bytes, payload), url, record_at)
    else:
        # links, directories, devices, FIFOs and unknown types are not sample members; the
        # records read for them do not carry over
        ext.drop()
    return pos


def _link_target(h: bytes, ext: _Extended) -> Link:
    """The target of the link member whose header is ``h`` (GNU long link or PAX linkpath
    records read before it applied)."""
    raw = ext.long_link
    if raw is None and ext.pax is not None:
        raw = ext.pax.get("linkpath")
    if raw is None:
        raw = h[157:257].partition(b"\x00")[0]
    return Link(raw.decode("utf-8", "surrogateescape"), h[156] == ord("1"))


def _members(src, url: str, with_data: bool, whole: bool, links: bool = False
             ) -> Iterator[tuple]:
    """Yield each regular file as (name, data, offset), or (name, offset, end) if not with_data;
    with ``links``, each hard or symbolic link as (name, Link, offset) too.

    ``offset`` is where the member's first record starts (long-name records included), ``end``
    the offset just past its padded data. ``whole=False`` parses a slice of an archive, which may
    be empty.
    """
    buf, base, end = src.buf, src.base, src.end
    pos = 0
    unpack = _HEADER.unpack_from
    regular = _REGULAR
    # field -> value caches: sizes repeat within a shard, and so do checksums, in a narrow range
    sizes: dict[bytes, int] = {}
    sums: dict[bytes, int] = {}
    ext = _Extended()  # long-name and PAX records that apply to the next member
    scan = _scan
    first = True
    while True:
        if end - pos < BLOCK:
            pos = src.refill(pos, BLOCK)
            buf, base, end = src.buf, src.base, src.end
            if end - pos < BLOCK:
                _check_end(src, pos, ext, whole, first)
                return
        if scan is not None and not ext.pending:
            # the plain members from here on, compiled; it stops before any header it leaves
            # to the code below
            parsed, pos = scan(buf, pos, end, base, with_data, _SCAN_COUNT, _SCAN_BYTES)
            if parsed:
                first = False
                yield from parsed
                continue
        first = False
        h = buf[pos : pos + BLOCK]
        name, size_f, chk_f, kind = unpack(h)
        if not _header_ok(h, chk_f, sums):
            if h == _ZERO:
                _end_of_archive(src, pos, ext)
                return
            raise ShardError("tar header checksum mismatch (corrupt archive)", url, base + pos)
        size = _member_size(size_f, sizes, url, base + pos)
        if kind not in regular:
            if links and kind in _LINKS:
                link = _link_target(h, ext)
                member, offset, _ = _member_name(h, name, ext, base + pos, size, url)
                pos = _other_record(src, pos, kind, size, ext, url)
                buf, base, end = src.buf, src.base, src.end
                yield member, link, offset
                continue
            pos = _other_record(src, pos, kind, size, ext, url)
            buf, base, end = src.buf, src.base, src.end
            continue
        member, offset, size = _member_name(h, name, ext, base + pos, size, url)
        data_at = pos + BLOCK
        pos = data_at + ((size + 511) & ~511)
        if pos <= end:
            yield (member, buf[data_at : data_at + size], offset) if with_data else \
                (member, offset, base + pos)
            continue
        what = f"member {member!r} (header at byte {base + data_at - BLOCK})"
        try:
            data = src.take(data_at, size, pos - data_at, with_data, what)
        except TruncatedShardError:
            # the header is intact, so this member's name says whether the sample before it
            # was complete; the consumer gets it with no data, then the error
            yield (member, None, offset) if with_data else (member, offset, None)
            raise
        buf, base, end = src.buf, src.base, src.end
        pos = 0
        yield (member, data, offset) if with_data else (member, offset, base)


def iter_members(source, url: str, *, whole: bool = True, links: bool = False
                 ) -> Iterator[tuple[str, bytes, int]]:
    """Yield ``(name, data, offset)`` for every regular file of a tar source, in order.

    ``source`` comes from :func:`open_tar_source` (or :func:`memory_source`); ``offset`` is where
    the member's records start. Raises ShardError (with the offset) on a corrupt header and
    TruncatedShardError when the archive ends early, after every member complete before that.
    When the cut falls inside a member whose header is intact, that member comes last with
    ``data=None``, right before the error: its name tells a consumer grouping members into
    samples that the sample before it is complete. With ``links``, a hard or symbolic link
    member comes as ``(name, Link, offset)`` (else links are skipped, as folders are).
    """
    return _members(source, url, True, whole, links)


def scan_members(source, url: str) -> Iterator[tuple[str, int, int]]:
    """Yield ``(name, start, end)`` byte spans of every regular file without keeping the data.

    Like :func:`iter_members`, a member cut off after its header comes last, with ``end=None``.
    """
    return _members(source, url, False, True)


def memory_source(data: bytes, url: str) -> _MemorySource:
    """A tar source over bytes already in memory (for example one sample's span from an index)."""
    return _MemorySource(data, url)
