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
