"""Writing WebDataset shards: TarWriter (one tar stream) and ShardWriter (a numbered series).

Headers are USTAR, with a PAX record for names longer than USTAR can hold; members of a sample are
written adjacently with extensions in sorted order. Values are encoded by extension (the last
component picks the encoder; a trailing ``.gz`` gzips the encoded bytes).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

from ember.shards.decode import (
    CBOR_EXTENSIONS,
    IMAGE_EXTENSIONS,
    INT_EXTENSIONS,
    JSON_EXTENSIONS,
    MSGPACK_EXTENSIONS,
    PICKLE_EXTENSIONS,
    TEXT_EXTENSIONS,
)
from ember.shards.format import check_sample_names, member_name
from ember.shards.index import INDEX_SUFFIX, make_index

__all__ = ["TarWriter", "ShardWriter", "encode_field", "shard_path"]

_PIL_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "ppm": "PPM", "pgm": "PPM",
                "pbm": "PPM", "pnm": "PPM", "webp": "WEBP", "tif": "TIFF", "tiff": "TIFF",
                "bmp": "BMP", "gif": "GIF"}


# formats whose encoding of a str is not its UTF-8 text: a str value is serialised like any other
_BINARY_FORMATS = MSGPACK_EXTENSIONS | CBOR_EXTENSIONS | PICKLE_EXTENSIONS | {"pth"}


def _image_bytes(ext: str, value: Any) -> bytes:
    from PIL import Image

    if not isinstance(value, Image.Image):
        import numpy as np
        import torch

        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            if t.ndim == 3:
                t = t.permute(1, 2, 0)
            value = t.numpy()
        if not isinstance(value, np.ndarray):
            raise TypeError(f"cannot encode {type(value).__name__} as .{ext}")
        arr: np.ndarray = value
        if arr.dtype != np.uint8:
            arr = (np.clip(arr, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
        if arr.ndim == 3 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        value = Image.fromarray(arr)
    buf = io.BytesIO()
    fmt = _PIL_FORMATS[ext]
    if fmt == "JPEG":
        if value.mode not in ("RGB", "L", "CMYK"):
            value = value.convert("RGB")
        value.save(buf, format=fmt, quality=95)
    else:
        value.save(buf, format=fmt)
    return buf.getvalue()


def _optional(module: str, ext: str):
    """An encoder package that is installed only by users who need it (as in webdataset)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"encoding a non-bytes value as {ext!r} needs the {module} package "
                          f"(pip install {module}), or pass bytes") from None


def encode_field(ext: str, value: Any) -> bytes:
    """Encode one field value for extension ``ext`` (bytes pass through unchanged)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if ext.endswith(".gz"):
        return gzip.compress(encode_field(ext[:-3], value), mtime=0)
    last = ext.rsplit(".", 1)[-1]
    if isinstance(value, str) and last not in _BINARY_FORMATS:
        # as in webdataset: a str is stored as UTF-8 text, so "json": json.dumps(obj) works
        return value.encode("utf-8")
    if last in INT_EXTENSIONS or (last in TEXT_EXTENSIONS and isinstance(value, (int, float))):
        return str(value).encode("ascii")
    if last in JSON_EXTENSIONS:
        return json.dumps(value).encode("utf-8")
    if last in ("npy", "npz"):
        import numpy as np

        buf = io.BytesIO()
        if last == "npy":
            np.save(buf, np.asarray(value), allow_pickle=False)
        else:
            np.savez(buf, **value)
        return buf.getvalue()
    if last == "pth":
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()
    if last in PICKLE_EXTENSIONS:
        import pickle

        return pickle.dumps(value)
    if last in MSGPACK_EXTENSIONS:
        return _optional("msgpack", ext).packb(value, use_bin_type=True)
    if last in CBOR_EXTENSIONS:
        return _optional("cbor2", ext).dumps(value)
    if last in IMAGE_EXTENSIONS:
        return _image_bytes(last, value)
    raise TypeError(f"no encoder for a {type(value).__name__} value with extension {ext!r}; "
                    "pass bytes")


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\x00" % (width - 1, value)


class TarWriter:
    """Write samples (dicts with ``__key__`` and ``ext: value``) to one tar stream.

    ``dest`` is a path or a binary file object (left open). ``compress=True`` (or a path ending in
    ``.gz``/``.tgz``) gzips the whole archive. ``mtime`` is stamped on every member.

    A path is written under a temporary name (``dest + ".writing"``) and renamed to ``dest`` by
    :meth:`close`; an exception inside ``with`` removes the temporary file instead, so a partial
    archive never appears under ``dest``. A sample whose key equals the previous sample's key is
    refused (readers would merge the two into one sample).
    """

    def __init__(self, dest: str | os.PathLike | BinaryIO, *, compress: bool | None = None,
                 mtime: int = 0, encode: bool = True):
        self._own = not hasattr(dest, "write")
        if self._own:
            path = str(dest)
            if compress is None:
                compress = path.endswith((".gz", ".tgz"))
            self.path: str | None = path
            self._tmp: str = path + ".writing"
            self._raw: BinaryIO = open(self._tmp, "wb", buffering=1 << 20)  # noqa: SIM115
        else:
            self.path = None
            self._tmp = ""
            self._raw = cast(BinaryIO, dest)
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", mtime=0) if compress else None
        self._out = self._gz if self._gz is not None else self._raw
        self._write = self._out.write
        self.encode = encode
        self.offset = 0
        self.count = 0
        self.spans: list[list] = []  # [key, start, end] per sample, for the index
        self._mtime = _octal(int(mtime), 12)
        self._closed = False
        self._last_key: str | None = None

    def _header(self, name: bytes, size: int, kind: bytes = b"0") -> bytes:
        if size >= 8**11:
            raise ValueError(f"member {name!r} of {size} bytes is too large (8 GiB limit)")
        h = bytearray(512)
        h[0 : len(name)] = name
        h[100:108] = b"0000644\x00"
        h[108:116] = b"0000000\x00"
        h[116:124] = b"0000000\x00"
        h[124:136] = _octal(size, 12)
        h[136:148] = self._mtime
        h[148:156] = b"        "
        h[156:157] = kind
        h[257:265] = b"ustar\x0000"
        h[329:337] = b"0000000\x00"
        h[337:345] = b"0000000\x00"
        h[148:156] = b"%06o\x00 " % sum(h)
        return bytes(h)

    def _member_headers(self, name: str, size: int) -> list[bytes]:
        raw = name.encode("utf-8")
        if len(raw) <= 100:
            return [self._header(raw, size)]
        # a PAX record carries the full name; the USTAR field keeps a truncated copy
        record = b" path=" + raw + b"\n"
        n = len(record)
        length = n + len(str(n))
        if len(str(length)) != len(str(n)):
            length = n + len(str(length))
        pax = str(length).encode() + record
        pad = b"\x00" * (-len(pax) % 512)
        return [self._header(b"././@PaxHeader", len(pax), b"x"), pax + pad,
                self._header(raw[:100], size)]

    def write(self, sample: dict[str, Any]) -> int:
        """Append one sample; returns the number of bytes it took in the archive."""
        if self._closed:
            raise ValueError("write to a closed TarWriter")
        key = sample.get("__key__")
        fields = sorted(k for k in sample if k[:2] != "__")
        check_sample_names(key, fields)
        assert isinstance(key, str)  # (checked above)
        if not fields:
            raise ValueError(f"sample {key!r} has no fields to write")
        if key == self._last_key:
            raise ValueError(f"sample key {key!r} equals the previous sample's key; readers would "
                             "merge the two into one sample (give each sample a unique key)")
        self._last_key = key
        write = self._write
        start = self.offset
        for ext in fields:
            value = sample[ext]
            data: bytes | bytearray | memoryview
            if self.encode or not isinstance(value, (bytes, bytearray, memoryview)):
                data = encode_field(ext, value)
            else:
                data = value
            size = len(data)
            for part in self._member_headers(member_name(key, ext), size):
                write(part)
                self.offset += len(part)
            write(data)
            pad = -size % 512
            if pad:
                write(b"\x00" * pad)
            self.offset += size + pad
        self.count += 1
        self.spans.append([key, start, self.offset])
        return self.offset - start

    def close(self) -> None:
        """Write the end-of-archive marker and close what this writer opened."""
        if self._closed:
            return
        self._closed = True
        self._write(b"\x00" * 1024)
        self.offset += 1024
        if self._gz is not None:
            self._gz.close()
        if self._own:
            self._raw.close()
            os.replace(self._tmp, cast(str, self.path))
        else:
            self._raw.flush()

    def abort(self) -> None:
        """Stop writing without finishing the archive: a path's temporary file is removed (a
        file object given to the writer is left as it is)."""
        if self._closed:
            return
        self._closed = True
        if self._own:
            try:
                self._raw.close()
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._tmp)

    def __enter__(self) -> TarWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()


def shard_path(pattern: str, n: int) -> str:
    """The name of shard ``n`` for a printf-style (``"out-%06d.tar"``) or ``str.format``
    (``"out-{:06d}.tar"``) pattern."""
    try:
        return pattern % n if "%" in pattern else pattern.format(n)
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"bad shard pattern {pattern!r} ({exc}); use e.g. 'out-%06d.tar' or "
                         "'out-{:06d}.tar'") from None


class ShardWriter:
    """Write samples into numbered shards, starting a new one after ``maxcount`` samples or
    before exceeding ``maxsize`` bytes.

    ``pattern`` is a printf-style (``"out-%06d.tar"``) or ``str.format`` (``"out-{:06d}.tar"``)
    path. Each shard is written to a temporary name and renamed when complete, so a crash never
    leaves a truncated shard under a final name; an exception inside ``with`` removes the shard
    being written (finished shards stay). ``index=True`` writes ``.idx`` files alongside;
    ``post(path)`` is called for each finished shard.

    ``opener(path)`` (as in webdataset) returns a binary file object to write shard ``path`` to
    (any file-like or remote target); the writer closes it when the shard is finished. With an
    opener there is no temporary name: an aborted shard is closed where it is, and ``index`` needs
    local files. ``verbose=1`` prints a line to stderr per shard started.
    """

    def __init__(self, pattern: str, maxcount: int = 100_000, maxsize: float = 3e9, *,
                 start_shard: int = 0, post: Callable[[str], Any] | None = None,
                 index: bool = False, mtime: int = 0, encode: bool = True, verbose: int = 0,
                 opener: Callable[[str], BinaryIO] | None = None):
        if opener is not None and index:
            raise ValueError("index=True writes .idx files next to local shards; it cannot be "
                             "used with opener=")
        if maxcount < 1 or maxsize < 1:
            raise ValueError(f"expected maxcount >= 1 and maxsize >= 1, got {maxcount}, {maxsize}")
        if shard_path(pattern, 0) == shard_path(pattern, 1):
            raise ValueError(f"shard pattern {pattern!r} has no shard number, so every shard would "
                             "get the same name; use e.g. 'out-%06d.tar' or 'out-{:06d}.tar'")
        self.pattern = pattern
        self.maxcount = maxcount
        self.maxsize = maxsize
        self.shard = start_shard
        self.post = post
        self.index = index
        self.mtime = mtime
        self.encode = encode
        self.verbose = verbose
        self.opener = opener
        self._stream: BinaryIO | None = None
        self.shards: list[str] = []
        self.total = 0
        self._tw: TarWriter | None = None
        self._path: str | None = None
        self._last_key: str | None = None

    def _open(self) -> None:
        self._path = shard_path(self.pattern, self.shard)
        self.shard += 1
        if self.verbose:
            print(f"# writing {self._path} ({self.total} samples so far)", file=sys.stderr)
        if self.opener is not None:
            self._stream = self.opener(self._path)
            if not hasattr(self._stream, "write"):
                raise TypeError(f"opener({self._path!r}) returned {type(self._stream).__name__}, "
                                "not a binary file object")
            self._tw = TarWriter(self._stream, compress=self._path.endswith((".gz", ".tgz")),
                                 mtime=self.mtime, encode=self.encode)
            return
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        self._tw = TarWriter(self._path, mtime=self.mtime, encode=self.encode)

    def _finish(self) -> None:
        tw, self._tw = self._tw, None
        if tw is None:
            return
        if tw.count == 0 and self.opener is None:  # only refused samples went to it: no empty shard
            tw.abort()
            return
        tw.close()
        self._close_stream()
        path = cast(str, self._path)  # set by _open with the TarWriter
        self.shards.append(path)
        if self.index:
            idx = make_index(path, tw.spans, os.path.getsize(path))
            Path(path + INDEX_SUFFIX).write_text(json.dumps(idx, separators=(",", ":")))
        if self.post is not None:
            self.post(path)

    def write(self, sample: dict[str, Any]) -> None:
        """Append one sample to the current shard (starting a new shard when full)."""
        if self.encode:
            sample = {k: (v if k[:2] == "__" else encode_field(k, v)) for k, v in sample.items()}
        size = 1024 + sum(len(v) + 1024 for k, v in sample.items() if k[:2] != "__")
        tw = self._tw
        if tw is not None and (tw.count >= self.maxcount or tw.offset + size > self.maxsize):
            self._finish()
            tw = None
        if tw is None:
            self._open()
            tw = cast(TarWriter, self._tw)
        tw.encode = False
        if tw.count == 0 and sample.get("__key__") == self._last_key:
            # the previous sample ended the last shard: readers of the series would merge the two
            tw._last_key = self._last_key
        tw.write(sample)
        self._last_key = sample.get("__key__")
        self.total += 1

    def close(self) -> None:
        """Finish the last shard."""
        self._finish()

    def abort(self) -> None:
        """Remove the shard being written (shards already finished stay)."""
        tw, self._tw = self._tw, None
        if tw is not None:
            tw.abort()
            self._close_stream()

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
