"""Every failure reading a shard is a ShardError naming the shard and an offset, and goes through
on_error, whatever path the shard is read by (local file, pipe:, HTTP with and without cache_dir)."""

from __future__ import annotations

import pytest
from test_remote import _http

from conftest import tar_bytes
from ember.shards import ShardDataset, ShardError, UrlOptions


def _huge_size_tar() -> tuple[bytes, int]:
    """A tar of three members whose second member's header claims 2**62 bytes (GNU base-256,
    a valid checksum); returns it and that header's offset."""
    data = bytearray(tar_bytes([("a.txt", b"x" * 10), ("b.txt", b"y" * 10), ("c.txt", b"z")]))
    at = 1024  # the header of b.txt
    field = bytes([0x80]) + (1 << 62).to_bytes(11, "big")
    data[at + 124 : at + 136] = field
    data[at + 148 : at + 156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\x00 " % sum(data[at : at + 512])
    return bytes(data), at


def _urls(tmp_path, kind: str, base: str | None = None) -> list[str]:
    if kind == "local":
        return [str(tmp_path / "good.tar"), str(tmp_path / "huge.tar")]
    if kind == "pipe":
        return [f"pipe:cat {tmp_path / 'good.tar'}", f"pipe:cat {tmp_path / 'huge.tar'}"]
    return [f"{base}/good.tar", f"{base}/huge.tar"]


@pytest.mark.parametrize("kind", ["local", "pipe", "http", "http-cache"])
def test_a_size_no_memory_holds_is_one_skipped_shard_error(tmp_path, kind):
    huge, at = _huge_size_tar()
    good = tar_bytes([("g0.txt", b"1"), ("g1.txt", b"2")])
    (tmp_path / "good.tar").write_bytes(good)
    (tmp_path / "huge.tar").write_bytes(huge)
    with _http({"/good.tar": good, "/huge.tar": huge}) as (base, _hits):
        options = UrlOptions(allow_pipe=True, timeout=5.0, retries=1, backoff=0.01,
                             cache_dir=str(tmp_path / "cache") if kind == "http-cache" else None)
        urls = _urls(tmp_path, kind, base)
        seen: list[Exception] = []
        ds = ShardDataset(urls, shuffle_shards=False, on_error=seen.append, url_options=options)
        assert [s["__key__"] for s in ds] == ["g0", "g1", "a"]
        assert len(seen) == 1 and isinstance(seen[0], ShardError)
        # as read from a local file: the archive ends inside that member's data
        assert seen[0].url == urls[1] and seen[0].offset == len(huge)
        assert f"member 'b.txt' (header at byte {at})" in str(seen[0])
        with pytest.raises(ShardError) as ei:
            list(ShardDataset(urls[1:], url_options=options))
        assert ei.value.url == urls[1] and ei.value.offset == len(huge)
