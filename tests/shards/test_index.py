"""Index files: what they hold, when they are stale, and checking spans against the shard."""

from __future__ import annotations

import json
import os

import pytest

from ember.shards import TarWriter
from ember.shards.index import index_mismatch, read_index, sample_count, write_index
from ember.shards.urls import expand_urls


def _spans_by_tarfile(path):
    import tarfile

    with tarfile.open(path) as tf:
        return [(m.name, m.offset, m.offset_data + ((m.size + 511) // 512) * 512)
                for m in tf.getmembers()]


def test_index_holds_size_keys_and_member_spans(shards):
    pattern, keys = shards
    url = expand_urls(pattern)[0]
    path = write_index(url)
    assert str(path) == url + ".idx"
    index = json.loads(path.read_text())
    assert index["size"] == os.path.getsize(url)
    assert [k for k, _, _ in index["samples"]] == keys[:10]
    members = _spans_by_tarfile(url)  # two members per sample: .bin then .cls
    for i, (_, start, end) in enumerate(index["samples"]):
        assert start == members[2 * i][1] and end == members[2 * i + 1][2]


def test_stale_index_is_ignored_with_a_warning(shards):
    pattern, _ = shards
    url = expand_urls(pattern)[0]
    write_index(url)
    assert sample_count(url) == 10
    with TarWriter(url) as w:  # rewritten with 3 samples: another size
        for i in range(3):
            w.write({"__key__": f"n{i}", "cls": i})
    with pytest.warns(UserWarning, match=f"ignoring stale index {url}.idx"):
        assert read_index(url) is None
    with pytest.warns(UserWarning, match="stale"):
        assert sample_count(url) == 3  # counted by a scan instead


def test_index_of_a_missing_shard_is_not_used(shards):
    pattern, _ = shards
    url = expand_urls(pattern)[0]
    write_index(url)
    os.remove(url)
    assert read_index(url) is None


def test_index_mismatch_checks_keys_at_their_spans(shards):
    pattern, keys = shards
    url = expand_urls(pattern)[0]
    index = json.loads(write_index(url).read_text())
    assert index_mismatch(url, index, range(10)) is None
    wrong_key = json.loads(json.dumps(index))
    wrong_key["samples"][4][0] = "other"
    assert index_mismatch(url, wrong_key, [4]) == (
        f"sample 4 at byte {index['samples'][4][1]} is {keys[4]!r}, the index says 'other'")
    assert index_mismatch(url, wrong_key, [3, 5]) is None  # only the positions asked about
    shifted = json.loads(json.dumps(index))
    shifted["samples"][2][1] += 512  # not a sample's first header any more
    reason = index_mismatch(url, shifted, [2])
    assert reason.startswith(f"sample 2 ({keys[2]!r}) is not at bytes")


def test_index_of_a_remote_shard_is_refused_before_reading_it():
    with pytest.raises(ValueError, match="local shards only"):
        write_index("http://127.0.0.1:9/a.tar")  # nothing listens there: a read would fail


@pytest.mark.parametrize("text", ["not json", "[]", '{"format": "ember-shard-index"}',
                                  '{"format": "other", "samples": []}',
                                  '{"format": "ember-shard-index", "samples": [["k", "0", 1]]}'])
def test_an_unreadable_index_is_ignored_with_a_warning_naming_it(shards, text):
    from test_cli_guards import ember

    from ember.shards import ShardDataset

    pattern, keys = shards
    url = expand_urls(pattern)[0]
    with open(url + ".idx", "w") as f:
        f.write(text)
    with pytest.warns(UserWarning, match=f"ignoring unreadable index {url}.idx"):
        assert read_index(url) is None
    with pytest.warns(UserWarning, match=f"{url}.idx"):
        assert sample_count(url) == 10  # counted by a scan instead
    r = ember("ls", "-q", url)  # the CLI says it in one line of its own
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().startswith(f"ember shards ls: ignoring unreadable index {url}.idx")
    assert r.stdout.decode().split()[0] == "10"
    with pytest.warns(UserWarning, match=f"{url}.idx"):
        ds = ShardDataset([url] * 2, equalize="drop", rank=0, world_size=2)
        assert len(list(ds)) == 10


def test_an_unreadable_remote_index_is_ignored_with_a_warning_naming_it(shards):
    from test_remote import _files, _http

    from ember.shards import ShardDataset, UrlOptions

    pattern, keys = shards
    files = _files(pattern)
    # a server answering 200 with a page of HTML where the index would be
    files.update({name + ".idx": b"<html>not found</html>" for name in list(files)})
    with _http(files) as (base, hits):
        urls = [base + name for name in sorted(files) if name.endswith(".tar")]
        options = UrlOptions(timeout=5.0, retries=1, backoff=0.01)
        with pytest.warns(UserWarning, match=f"ignoring unreadable index {urls[0]}.idx"):
            assert sample_count(urls[0], options) == 10
        with pytest.warns(UserWarning, match="unreadable index"):
            ds = ShardDataset(urls, equalize="drop", rank=0, world_size=2, url_options=options)
            assert len(list(ds)) == 30
