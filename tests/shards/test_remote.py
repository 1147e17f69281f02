"""Remote and damaged shards: HTTP (with drops), S3 (moto on loopback), pipe:, gzip, corruption."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ember.shards import ShardDataset, ShardError, TarWriter, TruncatedShardError, iter_shard
from ember.shards.urls import UrlOptions, expand_urls, open_url

FAST = UrlOptions(timeout=5.0, retries=3, backoff=0.01)


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@contextlib.contextmanager
def _http(files: dict[str, bytes], drop: dict[str, int] | None = None, honour_range: bool = True,
          shift: int = 0, cap: int = 0):
    """Serve ``files`` on 127.0.0.1 at an ephemeral port; ``drop[path]`` responses for that path
    send only a third of the body and close the connection (-1: every response, sending no body
    at all, so no attempt makes progress). A list of bytes as a file serves its n-th entry to
    the n-th request (the last one from then on). Every response has an ETag (a hash of the
    body's file), and a Range is honoured only where an If-Range sent with it matches. A
    ranged response starts ``shift`` bytes before the offset asked (at byte 0 at the earliest),
    and its Content-Range says where it starts; with ``cap`` it holds at most ``cap`` bytes (a
    part of the rest, as the standard allows) and its Content-Range says where it ends."""
    drop = dict(drop or {})
    hits: dict[str, int] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            data = files.get(self.path)
            with lock:
                hits[self.path] = hits.get(self.path, 0) + 1
                if isinstance(data, list):
                    data = data[min(hits[self.path], len(data)) - 1]
                left = drop.get(self.path, 0)
                if left > 0:
                    drop[self.path] = left - 1
            if data is None:
                self.send_error(404)
                return
            start = 0
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            rng = self.headers.get("Range")
            if_range = self.headers.get("If-Range")
            if rng and honour_range and if_range in (None, etag):
                start = int(rng.split("=")[1].split("-")[0])
            ranged = start > 0
            start = max(0, start - shift) if ranged else 0
            end = min(len(data), start + cap) if ranged and cap else len(data)
            body = data[start:end]
            self.send_response(206 if ranged else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("ETag", etag)
            self.end_headers()
            if left != 0:
                if left > 0:
                    self.wfile.write(body[: max(1, len(body) // 3)])
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _files(pattern):
    return {"/" + os.path.basename(p): _read(p) for p in expand_urls(pattern)}


def _keys_of(urls, options=FAST):
    return [s["__key__"] for u in urls for s in iter_shard(u, options)]


def test_http_reads_every_shard(shards):
    pattern, keys = shards
    with _http(_files(pattern)) as (base, hits):
        urls = [base + "/" + os.path.basename(p) for p in expand_urls(pattern)]
        ds = ShardDataset(urls, shuffle_shards=False, timeout=5, retries=2)
        got = [s["__key__"] for s in ds]
        assert got == keys
        assert all(n == 1 for n in hits.values())


@pytest.mark.parametrize("honour_range", [True, False])
def test_http_drops_mid_stream_are_retried(shards, honour_range):
    pattern, keys = shards
    files = _files(pattern)
    with _http(files, drop={p: 2 for p in files}, honour_range=honour_range) as (base, hits):
        urls = [base + p for p in sorted(files)]
        t = time.monotonic()
        got = [s for u in urls for s in iter_shard(u, FAST)]
        assert time.monotonic() - t < 30
        # nothing lost, repeated or garbled across reconnects
        assert [s["__key__"] for s in got] == keys
        local = [s for p in expand_urls(pattern) for s in iter_shard(p)]
        assert [(s["cls"], s["bin"]) for s in got] == [(s["cls"], s["bin"]) for s in local]
        assert all(n >= 3 for n in hits.values())  # two drops then a good response per shard


def test_http_always_dropping_gives_a_clear_error(shards):
    pattern, _ = shards
    files = _files(pattern)
    name = sorted(files)[0]
    with _http(files, drop={name: -1}) as (base, hits):
        url = base + name
        t = time.monotonic()
        with pytest.raises(ShardError, match="giving up after 4 failed attempts") as ei:
            _keys_of([url])
        assert time.monotonic() - t < 30
        assert ei.value.url == url and ei.value.offset == 0  # no byte ever arrived
        assert url in str(ei.value) and "at byte" in str(ei.value)
        assert hits[name] == 4  # the first attempt and 3 retries


def test_http_missing_shard_is_an_error_or_skipped(shards):
    pattern, keys = shards
    files = _files(pattern)
    with _http(files) as (base, _):
        urls = [base + p for p in sorted(files)] + [base + "/missing.tar"]
        with pytest.raises(ShardError, match="404") as ei:
            list(ShardDataset(urls, shuffle_shards=False, timeout=5))
        assert ei.value.url == base + "/missing.tar"
        ds = ShardDataset(urls, shuffle_shards=False, timeout=5, on_error="skip")
        assert [s["__key__"] for s in ds] == keys and ds.error_count == 1


def test_s3_shards_via_endpoint(s3, shards):
    import boto3

    pattern, keys = shards
    client = boto3.client("s3", endpoint_url=s3)
    client.create_bucket(Bucket="data")
    paths = expand_urls(pattern)
    for p in paths:
        client.put_object(Bucket="data", Key="train/" + os.path.basename(p), Body=_read(p))
    urls = [f"s3://data/train/{os.path.basename(p)}" for p in paths]
    ds = ShardDataset(urls, shuffle_shards=False, s3_endpoint=s3, timeout=10, retries=1)
    got = list(ds)
    assert [s["__key__"] for s in got] == keys
    assert got[0]["__url__"] == urls[0] and got[3]["cls"] == b"3"
    ds = ShardDataset("s3://data/train/s-{000..005}.tar", shuffle_shards=False, s3_endpoint=s3)
    assert [s["__key__"] for s in ds] == keys
    with pytest.raises(ShardError, match="NoSuchKey"):
        list(ShardDataset("s3://data/train/missing.tar", s3_endpoint=s3, retries=1))
    # a brace pattern over s3 URLs, and the endpoint taken from the environment
    os.environ["EMBER_S3_ENDPOINT_URL"] = s3
    try:
        brace = "s3://data/train/s-{000..005}.tar"
        assert _keys_of(expand_urls(brace), UrlOptions(timeout=10, retries=1)) == keys
    finally:
        del os.environ["EMBER_S3_ENDPOINT_URL"]
    with pytest.raises(ShardError, match="NoSuchKey") as ei:
        _keys_of(["s3://data/train/nope.tar"], UrlOptions(s3_endpoint=s3, timeout=10, retries=1))
    assert ei.value.url == "s3://data/train/nope.tar"


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.add(int(entry))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_pipe_urls_need_opt_in_and_are_reaped(shards):
    pattern, keys = shards
    paths = expand_urls(pattern)
    urls = [f"pipe:cat {p}" for p in paths]
    with pytest.raises(ShardError, match="allow_pipe"):
        list(ShardDataset(urls))
    before = _children(os.getpid())
    ds = ShardDataset(urls, shuffle_shards=False, allow_pipe=True)
    assert [s["__key__"] for s in ds] == keys
    # a stream closed before the command finished has ended and reaped the command
    stream = open_url(f"pipe:cat {paths[0]}", UrlOptions(allow_pipe=True))
    assert len(stream.read(100)) == 100
    stream.close()
    assert stream.proc.returncode is not None
    # stop early, in the middle of a shard whose command is still writing
    slow = [f"pipe:cat {paths[0]}; sleep 30"]
    it = iter(ShardDataset(slow, allow_pipe=True))
    assert next(it)["__key__"] == keys[0]
    t = time.monotonic()
    it.close()
    assert time.monotonic() - t < 10
    assert _children(os.getpid()) - before == set()  # no zombies, no leftovers


def test_pipe_failure_names_the_command(tmp_path):
    url = "pipe:exit 3"
    with pytest.raises(ShardError, match="status 3") as ei:
        list(iter_shard(url, UrlOptions(allow_pipe=True)))
    assert ei.value.url == url


def test_gzipped_shards_and_members(tmp_path):
    path = tmp_path / "z.tar.gz"
    with TarWriter(str(path)) as w:
        for i in range(5):
            w.write({"__key__": f"k{i}", "txt.gz": f"member {i}", "cls": i})
    assert _read(path)[:2] == b"\x1f\x8b"
    got = list(ShardDataset(str(path)).decode())
    assert [s["txt.gz"] for s in got] == [f"member {i}" for i in range(5)]
    assert [s["cls"] for s in got] == list(range(5))
    # a .tgz served over HTTP is detected by its magic bytes
    with _http({"/z.tgz": _read(path)}) as (base, _):
        assert _keys_of([base + "/z.tgz"]) == [f"k{i}" for i in range(5)]


def test_truncated_gzip_shard(tmp_path):
    path = tmp_path / "t.tar.gz"
    with TarWriter(str(path)) as w:
        for i in range(50):
            w.write({"__key__": f"k{i}", "bin": os.urandom(2000)})
    data = _read(path)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError) as ei:
        list(iter_shard(str(path)))
    assert ei.value.url == str(path)


@pytest.mark.parametrize("cut", [1, 4, 8, 11])
def test_a_gzip_shard_cut_in_its_trailer_is_truncated_and_never_cached(tmp_path, cut):
    from ember.shards import TruncatedShardError
    from ember.shards.index import sample_count

    path = tmp_path / "t.tar.gz"
    with TarWriter(str(path)) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "bin": bytes([i]) * 3000})
    data = _read(path)
    path.write_bytes(data[:-cut])  # the tar's end-of-archive blocks are all still there
    seen: list[Exception] = []
    got = [s["__key__"] for s in ShardDataset(str(path), on_error=seen.append)]
    assert got == [f"k{i}" for i in range(6)]
    assert len(seen) == 1 and isinstance(seen[0], TruncatedShardError)
    assert seen[0].url == str(path) and "gzip" in str(seen[0])
    with pytest.raises(TruncatedShardError):
        sample_count(str(path))
    cache = tmp_path / "cache"
    with _http({"/t.tar.gz": data[:-cut]}) as (base, _):
        options = UrlOptions(timeout=5.0, retries=1, backoff=0.01, cache_dir=str(cache))
        ds = ShardDataset(base + "/t.tar.gz", on_error="skip", url_options=options)
        assert len(list(ds)) == 6 and ds.error_count == 1
    assert not cache.exists() or os.listdir(cache) == []
    # whole, padded with zero bytes, or two gzip members one after the other: no error
    half = len(data) // 2
    for whole in (data, data + bytes(100), data[:10] + data[10:half] + data[half:]):
        path.write_bytes(whole)
        assert [s["__key__"] for s in ShardDataset(str(path))] == got


def test_a_gzip_shard_with_a_wrong_crc_is_an_error(tmp_path):
    path = tmp_path / "t.tar.gz"
    with TarWriter(str(path)) as w:
        for i in range(6):
            w.write({"__key__": f"k{i}", "bin": os.urandom(300_000)})
    data = bytearray(_read(path))
    data[-8] ^= 0xFF  # the CRC of the uncompressed data
    path.write_bytes(bytes(data))
    seen: list[Exception] = []
    list(ShardDataset(str(path), on_error=seen.append))  # the samples read before the error
    assert len(seen) == 1 and isinstance(seen[0], ShardError) and seen[0].url == str(path)


@pytest.fixture
def damaged(make_shards, tmp_path):
    pattern, keys = make_shards(4, 10, payload=600)
    paths = expand_urls(pattern)
    data = _read(paths[1])
    # a sample: .bin (header + 600 bytes padded to 1024) then .cls (header + 1 block)
    sample = 512 + 1024 + 512 + 512
    cut = 2 * sample + 512 + 100  # in the middle of the third sample's .bin data
    with open(paths[1], "wb") as f:
        f.write(data[:cut])
    garbage = bytearray(_read(paths[2]))
    bad_at = 4 * sample  # the fifth sample's first header gets a bad checksum
    garbage[bad_at : bad_at + 512] = b"\xff" * 512
    with open(paths[2], "wb") as f:
        f.write(garbage)
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    return paths, keys, cut, bad_at, str(empty)


def test_truncated_shard_error_names_shard_and_offset(damaged):
    paths, keys, cut, _, _ = damaged
    with pytest.raises(TruncatedShardError) as ei:
        list(iter_shard(paths[1]))
    err = ei.value
    assert err.url == paths[1]
    assert err.offset is not None and 2 * 2560 <= err.offset <= cut
    assert f"shard {paths[1]} at byte {err.offset}" in str(err)


def test_corrupt_header_error_names_offset(damaged):
    paths, _, _, bad_at, _ = damaged
    with pytest.raises(ShardError) as ei:
        list(iter_shard(paths[2]))
    assert ei.value.url == paths[2] and ei.value.offset == bad_at


def test_empty_shard_is_an_error(damaged):
    *_, empty = damaged
    with pytest.raises(ShardError, match="empty") as ei:
        list(iter_shard(empty))
    assert ei.value.url == empty and ei.value.offset == 0


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_damaged_shards_skipped_and_counted(damaged, mode):
    paths, keys, _, _, empty = damaged
    ds = ShardDataset(paths + [empty], shuffle_shards=False, on_error=mode)
    with warnings_ctx(mode) as rec:
        got = [s["__key__"] for s in ds]
    assert ds.error_count == 3
    # good shards complete; damaged ones contribute only whole samples read before the damage
    assert got[:10] == keys[:10] and got[-10:] == keys[30:40]
    middle = got[10:-10]
    # only whole samples from before each damage point: a prefix of each shard's samples, losing
    # at most the sample in progress (whose completeness cannot be known) beyond the damage
    first = [k for k in middle if k in keys[10:20]]
    second = [k for k in middle if k in keys[20:30]]
    assert first + second == middle
    assert first in (keys[10:11], keys[10:12]) and second in (keys[20:23], keys[20:24])
    if mode == "warn":
        assert len(rec) == 3 and all("skipped" in str(w.message) for w in rec)


def warnings_ctx(mode):
    import warnings

    if mode == "warn":
        return pytest.warns(UserWarning)
    return warnings.catch_warnings(record=True)


def test_on_error_callable_receives_errors(damaged):
    paths, *_ = damaged
    seen = []
    ds = ShardDataset(paths, shuffle_shards=False, on_error=seen.append)
    n = sum(1 for _ in ds)
    assert n >= 20 and len(seen) == 2
    assert {e.url for e in seen} == {paths[1], paths[2]}


def test_partial_sample_is_never_yielded(tmp_path):
    path = tmp_path / "p.tar"
    with TarWriter(str(path)) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "a": b"1" * 10, "b": b"2" * 10, "c": b"3" * 10})
    data = _read(path)
    # cut after sample k2's first member (3 members of 1024 bytes per sample)
    path.write_bytes(data[: 2 * 3 * 1024 + 1024])
    ds = ShardDataset(str(path), on_error="skip")
    got = list(ds)
    assert [s["__key__"] for s in got] == ["k0", "k1"]
    assert all(set(s) >= {"a", "b", "c"} for s in got) and ds.error_count == 1


def test_gzip_member_corrupt_is_decode_error(tmp_path):
    from ember.shards import DecodeError

    path = tmp_path / "g.tar"
    with TarWriter(str(path)) as w:
        w.write({"__key__": "ok", "txt.gz": gzip.compress(b"fine")})
        w.write({"__key__": "bad", "txt.gz": b"\x1f\x8bnot really gzip"})
    with pytest.raises(DecodeError, match="'bad'"):
        list(ShardDataset(str(path)).decode())
    ds = ShardDataset(str(path), on_error="skip").decode()
    assert [s["txt.gz"] for s in ds] == ["fine"] and ds.error_count == 1
