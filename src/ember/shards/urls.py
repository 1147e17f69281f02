"""Shard URLs: brace expansion, and opening a URL as a byte stream.

Supported: local paths and ``file:``, ``http(s)://`` (retries, timeouts, resume by byte range),
``s3://`` (boto3, imported only when used; endpoint configurable for MinIO/AIStore/moto),
``pipe:CMD`` (only when explicitly allowed; the process is always reaped) and ``tcp://HOST:PORT``
(what a server sends on connecting). More schemes: :func:`register_opener`. This is the only
module of ember.shards that touches the network or starts processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

from ember.shards.errors import NotFoundError, ShardError

__all__ = ["expand_urls", "open_url", "UrlOptions", "local_path", "parsed_to_end",
           "url_options_from", "register_opener", "sibling_url", "url_scheme", "file_beside",
           "Openers"]

MAX_TIMEOUT = 86400.0  # the longest socket timeout UrlOptions accepts, in seconds (a day)
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _matching_brace(s: str, start: int) -> int:
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced '{{' in URL pattern {s!r}")


def _split_top(body: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def _expand_one(s: str) -> list[str]:
    start = s.find("{")
    if start < 0:
        if "}" in s:
            raise ValueError(f"unbalanced '}}' in URL pattern {s!r}")
        return [s]
    end = _matching_brace(s, start)
    head, body, tail = s[:start], s[start + 1 : end], s[end + 1 :]
    m = _RANGE.match(body)
    if m:
        a, b = m.group(1), m.group(2)
        lo, hi = int(a), int(b)
        padded = (len(a) > 1 and a.startswith("0")) or (len(b) > 1 and b.startswith("0"))
        width = max(len(a), len(b)) if padded else 0
        step = 1 if hi >= lo else -1
        choices = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    elif "," in body:
        choices = [c for part in _split_top(body) for c in _expand_one(part)]
    else:
        raise ValueError(f"brace group {{{body}}} in {s!r} is neither a range a..b nor a list a,b")
    tails = _expand_one(tail)
    return [head + c + t for c in choices for t in tails]


def expand_urls(urls: str | Path | Iterable) -> list[str]:
    """Expand a URL spec into a flat list of shard URLs.

    Accepts a string with brace groups (``{000..012}`` keeps zero padding, ``{a,b}`` lists
    alternatives, several groups multiply out), a path, or a (nested) list of these.
    """
    if isinstance(urls, Path):
        return [str(urls)]
    if isinstance(urls, str):
        return _expand_one(urls)
    out: list[str] = []
    for item in urls:
        out.extend(expand_urls(item))
    return out


@dataclass(frozen=True)
class UrlOptions:
    """How shard URLs are opened (``ShardDataset(url_options=...)``, :func:`open_url`).

    ``timeout``: socket timeout in seconds, at most a day (:data:`MAX_TIMEOUT`); None waits
    without limit. ``retries``: consecutive failed attempts tolerated
    per shard (a resumed read that makes progress resets the count); ``backoff``: seconds before
    the first retry, doubling up to 5 s. ``headers``: extra HTTP request headers (for example
    an ``Authorization``). ``allow_pipe``: enables ``pipe:`` URLs, which run shell commands.
    ``s3_endpoint``: the S3 endpoint (else the ``EMBER_S3_ENDPOINT_URL`` or ``AWS_ENDPOINT_URL``
    environment variable, else AWS). ``cache_dir``: keep a local copy of every remote shard read
    whole and read the copy next time (see :mod:`ember.shards.cache`); ``cache_size`` bounds the
    cache in bytes.
    """

    timeout: float | None = 60.0
    retries: int = 5
    backoff: float = 0.2
    headers: Mapping[str, str] = field(default_factory=dict, hash=False)
    allow_pipe: bool = False
    s3_endpoint: str | None = None
    cache_dir: str | None = None
    cache_size: int | None = None

    def __post_init__(self) -> None:
        from ember.shards.checks import boolean, integer, real

        set_ = object.__setattr__  # frozen: the checked values replace the given ones
        if self.timeout is not None:
            set_(self, "timeout", real(self.timeout, "timeout", above=0.0, maximum=MAX_TIMEOUT))
        set_(self, "retries", integer(self.retries, "retries", minimum=0))
        set_(self, "backoff", real(self.backoff, "backoff", minimum=0.0))
        if not isinstance(self.headers, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()):
            raise TypeError(f"headers must map str to str, got {self.headers!r}")
        set_(self, "headers", dict(self.headers))
        set_(self, "allow_pipe", boolean(self.allow_pipe, "allow_pipe"))
        if self.cache_dir is not None:
            set_(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cache_size is not None:
            if self.cache_dir is None:
                raise ValueError("cache_size= needs cache_dir=")
            set_(self, "cache_size", integer(self.cache_size, "cache_size", minimum=0))


_OPTION_NAMES = ("timeout", "retries", "allow_pipe", "s3_endpoint", "cache_dir", "cache_size")


def url_options_from(url_options: UrlOptions | None, keywords: dict[str, Any]) -> UrlOptions:
    """``url_options``, or one made from the deprecated keywords that used to stand for its
    fields (with a DeprecationWarning); a TypeError for any other keyword or for both."""
    unknown = sorted(set(keywords) - set(_OPTION_NAMES))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
    if url_options is not None and not isinstance(url_options, UrlOptions):
        raise TypeError(f"url_options must be a UrlOptions, got {type(url_options).__name__}")
    if not keywords:
        return url_options or UrlOptions()
    names = ", ".join(f"{k}=" for k in keywords)
    if url_options is not None:
        raise TypeError(f"pass {names} inside url_options=, not beside it")
    warnings.warn(f"the keyword arguments {names} are deprecated: pass "
                  "url_options=UrlOptions(...) with the same fields", DeprecationWarning,
                  stacklevel=3)
    return UrlOptions(**keywords)


def local_path(url: str) -> Path | None:
    """The filesystem path of a local URL (plain path or ``file:``), else None."""
    if url.startswith("file:"):
        parsed = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(parsed.path if parsed.netloc in ("", "localhost") else url[5:])
        if sys.platform == "win32" and re.match(r"^/[A-Za-z]:", path):
            path = path[1:]
        return Path(path)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", url) and not re.match(r"^[A-Za-z]:[\\/]", url):
        return None
    return Path(url)


Opener = Callable[[str, "UrlOptions"], BinaryIO]


@dataclass(frozen=True)
class _Scheme:
    opener: Opener
    cacheable: bool
    siblings: bool


_SCHEMES: dict[str, _Scheme] = {}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def register_opener(scheme: str, opener: Opener, *, cacheable: bool = False,
                    siblings: bool = True) -> None:
    """Make :func:`open_url` open URLs ``scheme:...`` with ``opener(url, options)``.

    ``opener`` returns a readable binary stream (closed by the caller) and raises ShardError
    naming the URL when it cannot. ``cacheable``: ``cache_dir=`` keeps copies of these shards.
    ``siblings``: ``url + ".idx"`` names a file beside the shard, so an index may be looked up
    there (not for URLs that are commands or connections). A scheme registered again is
    replaced. Local paths use the scheme ``file``.
    """
    if not _SCHEME.match(scheme + ":") or len(scheme) < 2:
        raise ValueError(f"expected a URL scheme of two or more letters, digits, '+', '-', '.', "
                         f"got {scheme!r}")
    if not callable(opener):
        raise TypeError(f"opener must be callable, got {opener!r}")
    _SCHEMES[scheme.lower()] = _Scheme(opener, bool(cacheable), bool(siblings))


def url_scheme(url: str) -> str:
    """The scheme of a shard URL, lower-cased; ``file`` for a local path (Windows drive
    letters included)."""
    m = _SCHEME.match(url)
    return m.group(1).lower() if m else "file"


def _scheme(url: str) -> _Scheme:
    found = _SCHEMES.get(url_scheme(url))
    if found is None:
        known = ", ".join(f"{k}:" for k in sorted(_SCHEMES))
        raise ShardError(f"unsupported URL scheme {url_scheme(url)!r} (use a local path or one "
                         f"of {known})", url)
    return found


class Openers:
    """The openers that the URLs ``urls`` need beyond ember's built-in ones (schemes registered
    with :func:`register_opener`, or built-in schemes registered again).

    It looks them up when pickled and carries them (functions by reference, as pickle does);
    unpickling registers them again. A dataset holds one, so a process that unpickles the
    dataset (a DataLoader worker started with spawn or forkserver, a Ray worker), where a
    registration made under ``if __name__ == "__main__":`` never ran, opens those URLs as the
    process that pickled it does.
    """

    def __init__(self, urls: Iterable[str]):
        self.schemes = tuple(sorted({url_scheme(u) for u in urls}))

    def _registered(self) -> dict[str, _Scheme]:
        return {s: _SCHEMES[s] for s in self.schemes
                if s in _SCHEMES and _SCHEMES[s] is not _BUILT_IN.get(s)}

    def check_picklable(self) -> None:
        """Raise a TypeError naming the scheme whose opener pickle cannot carry to a worker
        process started with spawn or forkserver (a lambda, a nested function)."""
        import pickle

        for scheme, registered in self._registered().items():
            try:
                pickle.dumps(registered.opener)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise TypeError(
                    f"the opener registered for the URL scheme {scheme!r} "
                    f"({registered.opener!r}) cannot be pickled ({exc}), so worker processes "
                    "started with spawn or forkserver cannot open its URLs: register a function "
                    "defined at module level (or an instance of a class defined there)"
                ) from None

    def __reduce__(self):
        return (_registering, (self.schemes, self._registered()))


def _registering(schemes: tuple[str, ...], registered: dict[str, _Scheme]) -> Openers:
    """Unpickles an :class:`Openers`: registers what it carries."""
    _SCHEMES.update(registered)
    out = Openers.__new__(Openers)
    out.schemes = schemes
    return out


def sibling_url(url: str, suffix: str) -> str | None:
    """The URL of the file named like the shard plus ``suffix`` (its index: ``.idx``), or None
    where no file can lie beside it (``pipe:`` commands, unknown schemes)."""
    found = _SCHEMES.get(url_scheme(url))
    return url + suffix if found is not None and found.siblings else None


def open_url(url: str, options: UrlOptions | None = None) -> BinaryIO:
    """Open a shard URL for sequential reading; the caller must close the result."""
    options = options or UrlOptions()
    scheme = _scheme(url)
    if scheme.cacheable and options.cache_dir is not None:
        from ember.shards.cache import CachedReader, CachingStream, cache_path, open_cached

        final = cache_path(options.cache_dir, url)
        cached = open_cached(final)
        if cached is not None:
            return cached
        return CachedReader(CachingStream(scheme.opener(url, options), final,
                                          options.cache_size), 1 << 16)
    return scheme.opener(url, options)


def _open_file(url: str, options: UrlOptions) -> BinaryIO:
    path = local_path(url)
    if path is None:
        raise ShardError("not a local path", url)
    try:
        return open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except FileNotFoundError:
        raise NotFoundError("no such file", url) from None
    except OSError as exc:
        raise ShardError(f"cannot open: {exc}", url) from exc


def _open_pipe(url: str, options: UrlOptions) -> BinaryIO:
    if not options.allow_pipe:
        raise ShardError("pipe: URLs run shell commands and are disabled; pass allow_pipe=True", url)
    return cast(BinaryIO, _PipeStream(url[5:], url))


def file_beside(url: str, name: str, options: UrlOptions | None = None, *,
                required: bool = False) -> bytes | None:
    """The bytes of the file ``name`` in the folder of the shard ``url`` (a local path, or a URL
    whose scheme has files beside its shards: http(s), s3), or None where there is none (or
    can be none). Read whole, never cached. A remote file is an optional one: asked for once,
    without retries, and one that cannot be fetched (an unreachable server, a dropped
    connection) is None with a warning naming it, so the shards' own reads report the problem.
    With ``required`` (a writer that would otherwise drop what the file says), a remote file is
    read with ``options``' retries and one that cannot be fetched raises :class:`ShardError`
    naming its URL; only a file that is not there (HTTP 404, S3 NoSuchKey) is None."""
    path = local_path(url)
    if path is not None:
        try:
            return (path.parent / name).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError as exc:
            raise ShardError(f"cannot read {name} beside it: {exc}", url) from exc
    if sibling_url(url, "") is None or "/" not in url:
        return None
    options = options or UrlOptions()
    options = dataclasses.replace(options, retries=options.retries if required else 0,
                                  cache_dir=None, cache_size=None)
    where = url.rsplit("/", 1)[0] + "/" + name
    try:
        with open_url(where, options) as stream:
            return stream.read()
    except NotFoundError:
        return None
    except ShardError as exc:
        if required:
            raise ShardError(f"cannot read {where} ({exc.message})") from exc
        warnings.warn(f"cannot read {where} ({exc.message}); going on without it", stacklevel=2)
        return None


def parsed_to_end(stream: BinaryIO) -> None:
    """Tell a stream from :func:`open_url` that the tar parser reached the end of its archive
    without an error (a caching stream keeps its copy only then)."""
    complete = getattr(stream, "complete", None)
    if complete is not None:
        complete()


def _open_http(url: str, options: UrlOptions) -> BinaryIO:
    return cast(BinaryIO, _RetryingStream(url, _HttpOpener(url, options), options))


def _open_s3(url: str, options: UrlOptions) -> BinaryIO:
    return cast(BinaryIO, _RetryingStream(url, _S3Opener(url, options), options))


class _Transient(Exception):
    """A failure worth retrying (dropped connection, timeout, server error)."""


class _RetryingStream(io.RawIOBase):
    """A byte stream over a remote object that reconnects at the current offset on failure."""

    def __init__(self, url: str, opener, options: UrlOptions):
        self.url = url
        self._opener = opener
        self._options = options
        self._pos = 0
        self._total: int | None = None
        self._body = None
        self._failures = 0
        self._connect()

    def readable(self) -> bool:
        return True

    def _connect(self) -> None:
        while True:
            try:
                self._body, total = self._opener.open(self._pos)
                if total is not None:
                    self._total = total
                return
            except _Transient as exc:
                self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self._failures += 1
        self._drop()
        if self._failures > self._options.retries:
            raise ShardError(f"giving up after {self._failures} failed attempt"
                             f"{'s' if self._failures != 1 else ''}: {exc}",
                             self.url, self._pos) from exc
        time.sleep(min(self._options.backoff * 2 ** (self._failures - 1), 5.0))

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            with contextlib.suppress(Exception):
                body.close()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = 1 << 62
        while True:
            if self._total is not None and self._pos >= self._total:
                return b""
            if self._body is None:
                self._connect()
            try:
                data = self._opener.read(self._body, n)
            except _Transient as exc:
                self._fail(exc)
                continue
            if data:
                self._pos += len(data)
                self._failures = 0
                return data
            if self._total is None or self._pos >= self._total:
                return b""
            self._fail(_Transient(f"connection closed at {self._pos} of {self._total} bytes"))

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._drop()
        super().close()


def _changed(url: str, offset: int, how: str) -> ShardError:
    return ShardError(f"the object changed while it was being read ({how}); the bytes read "
                      "before belong to another version: read the shard again", url, offset)


_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*$", re.IGNORECASE)


def _check_start(url: str, offset: int, content_range: str | None) -> int | None:
    """Raise unless a partial response's ``Content-Range`` starts at ``offset``, the byte asked
    for: bytes from anywhere else would be stitched in as if they followed. Returns the object's
    size it states (None for ``*``): a server may send less than the rest, and the stream goes on
    to that size."""
    m = _CONTENT_RANGE.match(content_range or "")
    if m is not None and int(m.group(1)) == offset:
        return None if m.group(2) == "*" else int(m.group(2))
    answer = f"Content-Range: {content_range}" if content_range else "no Content-Range"
    raise ShardError(f"asked for bytes={offset}-, the server answered with {answer}; its bytes "
                     "would not continue the stream", url, offset)


class _HttpOpener:
    """GET with ``Range: bytes=N-`` through http.client, following redirects. The first
    response's ETag (or Last-Modified) is what every resumed request asks for (``If-Range``)
    and must match; a partial answer must start at the byte asked for (``Content-Range``), a
    whole one (200) is read past the bytes already read."""

    def __init__(self, url: str, options: UrlOptions):
        self.url = url
        self.timeout = options.timeout
        self.headers = dict(options.headers)
        self.etag: str | None = None
        self.modified: str | None = None
        self._seen = False  # whether a response was accepted (and its validators kept)

    def _request(self, url: str, offset: int):
        import http.client

        parts = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "", parts.port, timeout=self.timeout)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = dict(self.headers)
        if offset:
            headers["Range"] = f"bytes={offset}-"
            strong = self.etag if self.etag and not self.etag.startswith("W/") else None
            if strong or self.modified:
                headers["If-Range"] = strong or cast(str, self.modified)
        try:
            conn.request("GET", path, headers=headers)
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Transient(f"HTTP request failed: {exc}") from exc

    def _same_object(self, resp, offset: int) -> None:
        """Keep the first response's validators; raise if a later one names another version."""
        etag, modified = resp.getheader("ETag"), resp.getheader("Last-Modified")
        if not self._seen:
            self.etag, self.modified, self._seen = etag, modified, True
        elif self.etag and etag and etag != self.etag:
            raise _changed(self.url, offset, f"ETag {self.etag}, now {etag}")
        elif not self.etag and self.modified and modified and modified != self.modified:
            raise _changed(self.url, offset, f"Last-Modified {self.modified}, now {modified}")

    def open(self, offset: int):
        url = self.url
        for _ in range(6):
            conn, resp = self._request(url, offset)
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location"))
                conn.close()
                continue
            if resp.status == 416 and offset:
                conn.close()
                return _HttpBody(conn, None), offset
            if resp.status >= 500 or resp.status == 429:
                conn.close()
                raise _Transient(f"HTTP status {resp.status}")
            if resp.status not in (200, 206):
                conn.close()
                error = NotFoundError if resp.status in (404, 410) else ShardError
                raise error(f"HTTP status {resp.status} {resp.reason}", self.url)
            try:
                self._same_object(resp, offset)
            except ShardError:
                conn.close()
                raise
            size = None
            if resp.status == 206:
                try:
                    size = _check_start(self.url, offset, resp.getheader("Content-Range"))
                except ShardError:
                    conn.close()
                    raise
            length = resp.getheader("Content-Length")
            body = _HttpBody(conn, resp)
            if offset and resp.status == 200:  # server ignored the range: skip what we have
                body.discard(offset)
                return body, int(length) if length else None
            if size is not None:  # a part of the rest (the object's size says where it ends)
                return body, size
            return body, (offset + int(length)) if length else None
        raise ShardError("too many HTTP redirects", self.url)

    def read(self, body, n: int) -> bytes:
        import http.client

        try:
            return body.read(n)
        except http.client.IncompleteRead as exc:
            if exc.partial:
                return exc.partial
            raise _Transient("connection dropped mid-stream") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise _Transient(f"read failed: {exc}") from exc


class _HttpBody:
    def __init__(self, conn, resp):
        self.conn = conn
        self.resp = resp

    def read(self, n: int) -> bytes:
        if self.resp is None:
            return b""
        return self.resp.read(min(n, 1 << 24))

    def discard(self, n: int) -> None:
        while n > 0:
            chunk = self.resp.read(min(n, 1 << 20))
            if not chunk:
                raise _Transient("connection closed while skipping to the resume offset")
            n -= len(chunk)

    def close(self) -> None:
        self.conn.close()


_S3_CLIENTS: dict[tuple[int, int, str | None], object] = {}
_S3_LOCK = threading.Lock()


def _s3_client(endpoint: str | None, timeout: float | None):
    key = (os.getpid(), threading.get_ident(), endpoint)
    with _S3_LOCK:
        client = _S3_CLIENTS.get(key)
        if client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                raise ImportError("s3:// URLs need boto3: pip install 'ember[s3]'") from exc
            config = Config(connect_timeout=timeout, read_timeout=timeout,
                            retries={"max_attempts": 1, "mode": "standard"})
            client = boto3.client("s3", endpoint_url=endpoint, config=config)
            _S3_CLIENTS[key] = client
    return client


class _S3Opener:
    """``get_object`` with a byte range through boto3; resumed reads ask for the first
    response's version (``VersionId`` where the bucket keeps versions, else ``IfMatch`` on its
    ETag)."""

    def __init__(self, url: str, options: UrlOptions):
        parts = urllib.parse.urlsplit(url)
        self.url = url
        self.bucket = parts.netloc
        self.key = parts.path.lstrip("/")
        self.endpoint = (options.s3_endpoint or os.environ.get("EMBER_S3_ENDPOINT_URL")
                         or os.environ.get("AWS_ENDPOINT_URL") or None)
        self.timeout = options.timeout
        self.etag: str | None = None
        self.version: str | None = None

    def _request(self, offset: int) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key}
        if offset:
            kwargs["Range"] = f"bytes={offset}-"
            if self.version:
                kwargs["VersionId"] = self.version
            if self.etag:
                kwargs["IfMatch"] = self.etag
        return kwargs

    def open(self, offset: int):
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        client = _s3_client(self.endpoint, self.timeout)
        try:
            resp = client.get_object(**self._request(offset))
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "InvalidRange" and offset:
                return _Empty(), offset
            if code in ("PreconditionFailed", "NoSuchVersion") or status == 412:
                raise _changed(self.url, offset, f"{code or status}: it no longer is version "
                               f"{self.version or self.etag}") from None
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise _Transient(f"S3 error {code}") from exc
            error = NotFoundError if code in ("NoSuchKey", "NoSuchBucket") else ShardError
            raise error(f"S3 error {code or status}: {exc}", self.url) from None
        except (NoCredentialsError, PartialCredentialsError) as exc:
            raise ShardError(f"S3 credentials are missing or incomplete ({exc}); set "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile",
                             self.url) from None
        except BotoCoreError as exc:
            raise _Transient(f"S3 request failed: {exc}") from exc
        if not offset:
            self.etag, self.version = resp.get("ETag"), resp.get("VersionId")
        elif self.etag and resp.get("ETag") and resp["ETag"] != self.etag:
            resp["Body"].close()
            raise _changed(self.url, offset, f"ETag {self.etag}, now {resp['ETag']}")
        else:
            try:
                _check_start(self.url, offset, resp.get("ContentRange"))
            except ShardError:
                resp["Body"].close()
                raise
        length = resp.get("ContentLength")
        return resp["Body"], (offset + length) if length is not None else None

    def read(self, body, n: int) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return body.read(min(n, 1 << 24))
        except (BotoCoreError, OSError) as exc:
            raise _Transient(f"S3 read failed: {exc}") from exc


class _Empty:
    def read(self, n: int) -> bytes:
        return b""

    def close(self) -> None:
        pass


class _PipeStream(io.RawIOBase):
    """The standard output of a shell command; close() always ends and reaps the process."""

    def __init__(self, command: str, url: str):
        self.url = url
        kwargs: dict = {}
        if sys.platform == "win32":
            kwargs["creationflags"] = subprocess.CREATE_NEW_PROCESS_GROUP
        else:
            kwargs["start_new_session"] = True
        self.proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, **kwargs)

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        out = cast(io.BufferedReader, self.proc.stdout)
        # read1: return what the command has written so far instead of waiting for n bytes
        data = out.read1(n) if n is not None and n > 0 else out.read()
        if not data:
            status = self.proc.wait()
            if status != 0:
                raise ShardError(f"pipe command exited with status {status}", self.url)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        proc = self.proc
        if proc.stdout is not None and not proc.stdout.closed:
            proc.stdout.close()
        if proc.poll() is None:
            _terminate(proc)
        super().close()


def _terminate(proc: subprocess.Popen) -> None:
    try:
        if sys.platform == "win32":
            proc.kill()
        else:
            os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            if sys.platform == "win32":
                proc.kill()
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def as_list(urls: str | Sequence[str]) -> list[str]:
    """Expand a spec to a list, raising ValueError when it names no shard."""
    out = expand_urls(urls)
    if not out:
        raise ValueError("no shard URLs given")
    return out


def _open_tcp(url: str, options: UrlOptions) -> BinaryIO:
    """``tcp://HOST:PORT``: the bytes a server sends on connecting (a producer streaming a
    shard), with ``options.timeout`` per connect and read; not resumable."""
    import socket

    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ShardError("expected tcp://HOST:PORT", url)
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=options.timeout)
    except OSError as exc:
        raise ShardError(f"cannot connect: {exc}", url) from exc
    with sock:  # the file keeps the connection open until it is closed
        return sock.makefile("rb")


register_opener("file", _open_file)
register_opener("http", _open_http, cacheable=True)
register_opener("https", _open_http, cacheable=True)
register_opener("s3", _open_s3, cacheable=True)
register_opener("pipe", _open_pipe, siblings=False)
register_opener("tcp", _open_tcp, siblings=False)
_BUILT_IN = dict(_SCHEMES)  # what a fresh process has: Openers carries only what differs
