"""URL schemes: one registry of openers, index files looked up only where one can exist, remote
objects that change while being read, and credentials errors."""

from __future__ import annotations

import os

import pytest
from test_cli_guards import ember

from ember.shards import ShardDataset, UrlOptions
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
