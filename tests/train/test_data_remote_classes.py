"""``ember train`` reads the classes.json beside remote shards (served here over HTTP on
127.0.0.1), as it does beside local ones."""

from __future__ import annotations

import functools
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ember.train.data import read_class_names
from ember.train.errors import ConfigError


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


@pytest.fixture
def served(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(_Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_classes_json_beside_remote_shards_is_read(served):
    root, base = served
    for folder, names in [("a", ["cat", "dog"]), ("b", ["cat", "dog"]), ("c", ["x"])]:
        (root / folder).mkdir()
        (root / folder / "classes.json").write_text(json.dumps({"classes": names}))
    (root / "none").mkdir()
    assert read_class_names(f"{base}/a/s-{{000..002}}.tar") == ["cat", "dog"]
    assert read_class_names([f"{base}/a/s-000.tar", f"{base}/b/s-000.tar"]) == ["cat", "dog"]
    assert read_class_names(f"{base}/none/s-000.tar") is None
    with pytest.raises(ConfigError, match="name other classes"):
        read_class_names([f"{base}/a/s-000.tar", f"{base}/c/s-000.tar"])
    (root / "none" / "classes.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a classes.json"):
        read_class_names(f"{base}/none/s-000.tar")
