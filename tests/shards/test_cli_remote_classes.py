"""``ember shards split/merge/shuffle`` with a ``classes.json`` beside remote input shards that the
server fails to send: the writers must not drop the labels' class names silently."""

from __future__ import annotations

import pytest
from test_cli_guards import ember, one_error_line
from test_remote import _files, _http

from ember.shards import urls as urls_module


@pytest.mark.parametrize("command, flags", [("split", ()), ("merge", ()),
                                            ("shuffle", ("--buffer", "4"))])
def test_a_classes_json_that_cannot_be_fetched_stops_a_writer(shards, tmp_path, monkeypatch,
                                                               command, flags):
    pattern, _ = shards
    monkeypatch.setattr(urls_module.time, "sleep", lambda s: None)
    files = {**_files(pattern), "/classes.json": b'{"classes": ["a", "b"]}'}
    out = tmp_path / "out"
    with _http(files, drop={"/classes.json": -1}) as (base, hits):  # every answer cut short
        proc = ember(command, "-q", *flags, base + "/s-000.tar", "-o", str(out / "o-%03d.tar"))
        line = one_error_line(proc, command)
        assert f"{base}/classes.json" in line
        assert hits["/classes.json"] > 1  # retried as any remote read is
    assert not out.exists() or not any(out.iterdir())


def test_a_classes_json_that_cannot_be_fetched_is_not_called_missing(shards, tmp_path,
                                                                     monkeypatch):
    pattern, _ = shards
    monkeypatch.setattr(urls_module.time, "sleep", lambda s: None)
    files = {**_files(pattern), "/classes.json": b'{"classes": ["a", "b"]}'}
    files.update({"/x" + k: v for k, v in files.items()})
    with _http(files, drop={"/x/classes.json": -1}) as (base, _):
        proc = ember("split", "-q", base + "/s-000.tar", base + "/x/s-001.tar",
                     "-o", str(tmp_path / "o-%03d.tar"))
        line = one_error_line(proc, "split")
        assert f"{base}/x/classes.json" in line and "have none" not in line


def test_a_classes_json_that_is_not_there_leaves_the_output_without_one(shards, tmp_path):
    pattern, _ = shards
    with _http(_files(pattern)) as (base, _):  # classes.json: 404
        proc = ember("split", "-q", base + "/s-000.tar", "-o", str(tmp_path / "out/o-%03d.tar"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["o-000.tar"]
