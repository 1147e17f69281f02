"""HTTP with dropped connections, and pipe: gating and reaping."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ember.shards import ShardError, iter_shard
from ember.shards.urls import expand_urls


@pytest.fixture
def http_server(shards):
    pattern, keys = shards
    files = {"/" + p.rsplit("/", 1)[1]: Path(p).read_bytes() for p in expand_urls(pattern)}
    drops = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            data = files.get(self.path)
            if data is None:
                self.send_error(404)
                return
            start = 0
            rng = self.headers.get("Range")
            if rng:
                start = int(rng.split("=")[1].split("-")[0])
            body = data[start:]
            self.send_response(206 if rng else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if drops.get(self.path, 0) < 2:  # the first two responses drop mid-stream
                drops[self.path] = drops.get(self.path, 0) + 1
                self.wfile.write(body[: len(body) // 3])
                self.wfile.flush()
                self.connection.shutdown(2)
                return
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", pattern
    server.shutdown()


def test_http_resumes_after_dropped_connections(http_server):
    base, pattern = http_server
    local = expand_urls(pattern)[0]
    url = base + "/" + local.rsplit("/", 1)[1]
    got = [(s["__key__"], s["bin"]) for s in iter_shard(url)]
    assert got == [(s["__key__"], s["bin"]) for s in iter_shard(local)]
    with pytest.raises(ShardError, match="404"):
        list(iter_shard(base + "/missing.tar"))


def test_pipe_is_off_by_default_and_reaped(shards):
    pattern, _ = shards
    local = expand_urls(pattern)[0]
    cmd = (f"pipe:\"{sys.executable}\" -c \"import sys,shutil;"
           f"shutil.copyfileobj(open(r'{local}','rb'),sys.stdout.buffer)\"")
    with pytest.raises(ShardError, match="allow_pipe"):
        list(iter_shard(cmd))
    from ember.shards.urls import UrlOptions, open_url

    stream = open_url(cmd, UrlOptions(allow_pipe=True))
    stream.read(100)
    stream.close()
    assert stream.proc.returncode is not None  # ended and reaped
    n = sum(1 for _ in iter_shard(cmd, UrlOptions(allow_pipe=True)))
    assert n == 10
