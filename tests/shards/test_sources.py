"""URL schemes: one registry of openers, index files looked up only where one can exist, remote
objects that change while being read, and credentials errors."""

from __future__ import annotations

import dataclasses
import os

import pytest
from test_cli_guards import ember

from ember.shards import ShardDataset, UrlOptions, open_url
from ember.shards.index import read_index, sample_count
from ember.shards.urls import expand_urls


def test_a_pipe_url_never_runs_its_command_again_to_find_an_index(shards, tmp_path):
    pattern, keys = shards
    first = expand_urls(pattern)[0]
    copy = tmp_path / "copy"
    url = f"pipe:cat {first} | tee {copy}"
    options = UrlOptions(allow_pipe=True)
    assert read_index(url, options) is None
    assert sample_count(url, options) == 10
    assert not os.path.exists(f"{copy}.idx")
    urls = [f"pipe:cat {u} | tee {copy}" for u in expand_urls(pattern)]
    ds = ShardDataset(urls, equalize="drop", world_size=2, rank=0, url_options=options)
    assert len(list(ds)) == 30
    assert not os.path.exists(f"{copy}.idx")
    r = ember("ls", "--allow-pipe", url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines()[0].startswith("10\t")
    assert not os.path.exists(f"{copy}.idx")


def test_a_registered_scheme_is_opened_cached_and_indexed_like_the_built_in_ones(
        shards, tmp_path, monkeypatch):
    from ember.shards import register_opener
    from ember.shards import urls as urls_module
    from ember.shards.urls import sibling_url

    monkeypatch.setattr(urls_module, "_SCHEMES", dict(urls_module._SCHEMES))  # undone after

    pattern, keys = shards
    paths = expand_urls(pattern)
    opened: list[str] = []

    def opener(url: str, options: UrlOptions):
        opened.append(url)
        return open(paths[int(url.split(":", 1)[1])], "rb")

    register_opener("mem-test", opener, cacheable=True, siblings=False)
    urls = [f"mem-test:{i}" for i in range(len(paths))]
    options = UrlOptions(cache_dir=str(tmp_path / "cache"))
    ds = ShardDataset(urls, shuffle_shards=False, url_options=options)
    assert [s["__key__"] for s in ds] == keys
    assert [s["__key__"] for s in ds] == keys  # the second epoch reads the copies
    assert opened == urls
    assert sibling_url(urls[0], ".idx") is None and sibling_url(paths[0], ".idx") == paths[0] + ".idx"
    assert sibling_url("pipe:cat a", ".idx") is None
    with pytest.raises(ValueError, match="scheme"):
        register_opener("a b", opener)
    from ember.shards import ShardError

    with pytest.raises(ShardError, match="unsupported URL scheme 'nope'.*mem-test:"):
        list(ShardDataset(["nope://x.tar"]))


def _two_versions(tmp_path):
    from test_remote import _read

    from ember.shards import ShardWriter

    versions = []
    for v in range(2):
        with ShardWriter(str(tmp_path / f"v{v}-%d.tar"), maxcount=100) as w:
            for i in range(20):
                w.write({"__key__": f"k{i:03d}", "bin": bytes([v]) * 2000})
        versions.append(_read(tmp_path / f"v{v}-0.tar"))
    return versions


@pytest.mark.parametrize("honour_range", [True, False])
def test_a_resumed_http_read_of_a_replaced_object_names_the_shard(tmp_path, honour_range):
    from test_remote import _http

    from ember.shards import ShardError

    old, new = _two_versions(tmp_path)
    fast = UrlOptions(timeout=5.0, retries=3, backoff=0.01)
    # the first response is cut after a third of the body; the object is replaced before the
    # read resumes
    with _http({"/s.tar": [old, new]}, drop={"/s.tar": 1}, honour_range=honour_range) as (
            base, hits):
        seen: list[Exception] = []
        ds = ShardDataset([base + "/s.tar"], on_error=seen.append, url_options=fast)
        got = list(ds)
        assert all(s["bin"] == bytes([0]) * 2000 for s in got) and len(got) < 20
        assert len(seen) == 1 and isinstance(seen[0], ShardError)
        assert seen[0].url == base + "/s.tar" and "changed while it was being read" in str(seen[0])
        assert hits["/s.tar"] == 2  # not retried: the error is final
    # unchanged, the resumed read goes on as before
    with _http({"/s.tar": old}, drop={"/s.tar": 1}, honour_range=honour_range) as (base, hits):
        assert len(list(ShardDataset([base + "/s.tar"], url_options=fast))) == 20
        assert hits["/s.tar"] == 2


def test_url_options_headers_are_sent(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    old, _ = _two_versions(tmp_path)
    got: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            got.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Length", str(len(old)))
            self.end_headers()
            self.wfile.write(old)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/s.tar"
        options = UrlOptions(timeout=5.0, headers={"Authorization": "Bearer t"})
        assert len(list(ShardDataset([url], url_options=options))) == 20
    finally:
        server.shutdown()
        server.server_close()
    assert got == ["Bearer t"]


def test_a_resumed_s3_read_of_a_replaced_object_names_the_shard(s3, tmp_path):
    import boto3

    from ember.shards import ShardError

    old, new = _two_versions(tmp_path)
    client = boto3.client("s3", endpoint_url=s3)
    client.create_bucket(Bucket="data")
    client.put_object(Bucket="data", Key="s.tar", Body=old)
    options = UrlOptions(s3_endpoint=s3, timeout=10.0, retries=2, backoff=0.01)
    for replace in (False, True):
        stream = open_url("s3://data/s.tar", options)
        try:
            head = stream.read(5000)
            if replace:
                client.put_object(Bucket="data", Key="s.tar", Body=new)
            stream._drop()  # the connection drops: the next read resumes at byte 5000
            if replace:
                with pytest.raises(ShardError, match="changed while it was being read") as ei:
                    stream.read()
                assert ei.value.url == "s3://data/s.tar" and ei.value.offset == 5000
            else:
                assert head + stream.read() == old
        finally:
            stream.close()


def test_missing_s3_credentials_are_one_clear_error_without_retries(s3, monkeypatch):
    from ember.shards import ShardError
    from ember.shards import urls as urls_module

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    import boto3

    monkeypatch.setattr(urls_module, "_S3_CLIENTS", {})  # no client made with credentials
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # nor credentials a session keeps
    sleeps: list[float] = []
    monkeypatch.setattr(urls_module.time, "sleep", sleeps.append)
    options = UrlOptions(s3_endpoint=s3, timeout=10.0, retries=5, backoff=1.0)
    with pytest.raises(ShardError, match="credentials") as ei:
        list(ShardDataset(["s3://data/a.tar"], url_options=options))
    assert ei.value.url == "s3://data/a.tar"
    assert sleeps == []  # given up at once, not after 5 retries


def test_tcp_urls_read_what_a_server_sends(shards):
    import socket
    import threading

    from test_remote import _read

    from ember.shards import ShardError

    pattern, keys = shards
    paths = expand_urls(pattern)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        for p in paths:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(_read(p)[: 3000] if p == paths[-1] else _read(p))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        url = f"tcp://127.0.0.1:{port}"
        ds = ShardDataset([url] * len(paths), shuffle_shards=False, on_error="skip",
                          url_options=UrlOptions(timeout=30.0))
        got = [s["__key__"] for s in ds]
        assert got[:50] == keys[:50] and ds.error_count == 1  # the last one arrives cut short
        thread.join(timeout=30)
        assert read_index(url) is None
    finally:
        listener.close()
    with pytest.raises(ShardError, match="cannot connect") as ei:
        list(ShardDataset([url]))
    assert ei.value.url == url
    with pytest.raises(ShardError, match="tcp://HOST:PORT"):
        list(ShardDataset(["tcp://127.0.0.1/a.tar"]))


@pytest.mark.parametrize("shift", [10240, 777, 1 << 30])
def test_a_resumed_http_read_that_starts_elsewhere_is_an_error_naming_the_offset(
        tmp_path, shift):
    from test_remote import _http

    from ember.shards import ShardError

    old, _ = _two_versions(tmp_path)
    fast = UrlOptions(timeout=5.0, retries=3, backoff=0.01)
    cache = tmp_path / "cache"
    # the first response is cut after a third of the body; the resumed one starts `shift` bytes
    # before the offset asked (1 << 30: at byte 0), and its Content-Range says so
    with _http({"/s.tar": old}, drop={"/s.tar": 1}, shift=shift) as (base, hits):
        seen: list[Exception] = []
        options = dataclasses.replace(fast, cache_dir=str(cache))
        got = list(ShardDataset([base + "/s.tar"], on_error=seen.append, url_options=options))
        assert len(got) < 20 and len({s["__key__"] for s in got}) == len(got)
        assert all(s["bin"] == bytes([0]) * 2000 for s in got)
        assert len(seen) == 1 and isinstance(seen[0], ShardError)
        cut = len(old) // 3
        assert seen[0].url == base + "/s.tar" and seen[0].offset == cut
        assert f"bytes={cut}-" in str(seen[0]) and "Content-Range" in str(seen[0])
        assert hits["/s.tar"] == 2  # not retried: the error is final
    assert not cache.exists() or os.listdir(cache) == []
    # the same server answering from the offset asked: the read goes on as before
    with _http({"/s.tar": old}, drop={"/s.tar": 1}) as (base, hits):
        assert len(list(ShardDataset([base + "/s.tar"], url_options=fast))) == 20
        assert hits["/s.tar"] == 2


def test_a_resumed_http_read_answered_in_parts_reads_on_to_the_objects_end(tmp_path):
    # a 206 may hold less than the rest (its Content-Range ends before the object's size): the
    # stream asks again from where it ended instead of taking the part's end for the shard's end
    from test_remote import _http

    old, _ = _two_versions(tmp_path)
    fast = UrlOptions(timeout=5.0, retries=3, backoff=0.01)
    with _http({"/s.tar": old}, drop={"/s.tar": 1}, cap=len(old) // 5) as (base, hits):
        seen: list[Exception] = []
        got = list(ShardDataset([base + "/s.tar"], on_error=seen.append, url_options=fast))
        assert seen == [] and len(got) == 20
        assert hits["/s.tar"] >= 4


def test_a_resumed_s3_read_that_starts_elsewhere_is_an_error_naming_the_offset(
        s3, tmp_path, monkeypatch):
    import boto3

    from ember.shards import ShardError
    from ember.shards import urls as urls_module

    old, _ = _two_versions(tmp_path)
    client = boto3.client("s3", endpoint_url=s3)
    client.create_bucket(Bucket="data")
    client.put_object(Bucket="data", Key="s.tar", Body=old)
    make_client = urls_module._s3_client

    class Shifted:  # a client whose ranged answers start 1000 bytes before the offset asked
        def __init__(self, real):
            self.real = real

        def get_object(self, **kwargs):
            if "Range" in kwargs:
                start = int(kwargs["Range"][6:].rstrip("-"))
                kwargs["Range"] = f"bytes={start - 1000}-"
            return self.real.get_object(**kwargs)

    monkeypatch.setattr(urls_module, "_s3_client", lambda *a: Shifted(make_client(*a)))
    options = UrlOptions(s3_endpoint=s3, timeout=10.0, retries=2, backoff=0.01)
    stream = open_url("s3://data/s.tar", options)
    try:
        assert stream.read(5000) == old[:5000]
        stream._drop()  # the connection drops: the next read resumes at byte 5000
        with pytest.raises(ShardError, match="Content-Range") as ei:
            stream.read()
        assert ei.value.url == "s3://data/s.tar" and ei.value.offset == 5000
    finally:
        stream.close()


def test_a_file_beside_remote_shards_is_looked_up_once_and_never_names_a_shard(
        shards, monkeypatch):
    import socket

    from test_remote import _files, _http

    from ember.shards import urls as urls_module
    from ember.shards.urls import file_beside

    pattern, _ = shards
    sleeps: list[float] = []
    monkeypatch.setattr(urls_module.time, "sleep", sleeps.append)
    options = UrlOptions(timeout=5.0, retries=5, backoff=1.0)
    files = {**_files(pattern), "/classes.json": b'{"classes": ["a", "b"]}'}
    with _http(files, drop={"/classes.json": -1}) as (base, hits):  # every answer cut short
        shard = base + "/s-000.tar"
        with pytest.warns(UserWarning, match=rf"cannot read {base}/classes.json\b") as record:
            assert file_beside(shard, "classes.json", options) is None
        assert not any("shard" in str(w.message) for w in record)
        assert hits["/classes.json"] == 1 and sleeps == []  # one attempt, no backoff
        assert file_beside(shard, "missing.json", options) is None  # 404: no file, no warning
    with _http(files) as (base, hits):
        assert file_beside(base + "/s-000.tar", "classes.json") == files["/classes.json"]
    # nothing listens there: one attempt, then None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.warns(UserWarning, match="classes.json"):
        assert file_beside(f"http://127.0.0.1:{port}/s.tar", "classes.json", options) is None
    assert sleeps == []


def _open_after_colon(url: str, options: UrlOptions):
    """An opener at module level: pickle carries it to a worker by reference."""
    return open(url.split(":", 1)[1], "rb")


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_registered_scheme_reaches_workers_started_with_spawn(shards, monkeypatch):
    from ember.shards import ShardLoader, register_opener
    from ember.shards import urls as urls_module

    # registered in this process only, as under `if __name__ == "__main__":`: a spawned worker
    # imports ember afresh and knows the built-in schemes alone
    monkeypatch.setattr(urls_module, "_SCHEMES", dict(urls_module._SCHEMES))
    pattern, keys = shards
    register_opener("spawn-test", _open_after_colon)
    urls = [f"spawn-test:{p}" for p in expand_urls(pattern)]
    loader = ShardLoader(ShardDataset(urls, nodesplitter=None), num_workers=2,
                         multiprocessing_context="spawn")
    assert sorted(s["__key__"] for s in loader) == sorted(keys)
    # an opener that pickle cannot carry: a TypeError naming the scheme, before any worker
    register_opener("spawn-test", lambda url, options: _open_after_colon(url, options))
    loader = ShardLoader(ShardDataset(urls, nodesplitter=None), num_workers=2,
                         multiprocessing_context="spawn")
    with pytest.raises(TypeError, match=r"'spawn-test'.*module level"):
        next(iter(loader))
    # forked workers inherit it as it is
    loader = ShardLoader(ShardDataset(urls, nodesplitter=None), num_workers=2,
                         multiprocessing_context="fork")
    assert sorted(s["__key__"] for s in loader) == sorted(keys)
