"""Splitting over ranks and workers, per-epoch shuffling, exact mid-epoch resumption, equalize."""

from __future__ import annotations

import json
import os
import random
import warnings
from collections import Counter

import pytest

from ember.shards import ShardDataset, ShardError, ShardLoader, ShardWriter, TarWriter, plan
from ember.shards.index import write_index
from ember.shards.urls import expand_urls

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WORKERS = 3
WORLD = 2


def _key(item):
    """A sample's key; items that stages already made into keys (or batches of keys) as they are."""
    return item["__key__"] if isinstance(item, dict) else item


def _loader_keys(ds: ShardDataset, num_workers: int) -> list[str]:
    return [s["__key__"] for s in ShardLoader(ds, num_workers=num_workers)]


@pytest.fixture
def twelve(make_shards):
    """12 shards of 8 samples."""
    return make_shards(12, 8)


def _uneven(tmp_path, sizes):
    urls, keys = [], []
    for i, n in enumerate(sizes):
        path = str(tmp_path / f"u-{i:03d}.tar")
        with ShardWriter(path.replace(f"{i:03d}", "%03d"), maxcount=10**6, start_shard=i) as w:
            for j in range(n):
                key = f"u{i:03d}_{j:03d}"
                keys.append(key)
                w.write({"__key__": key, "cls": j})
        urls.append(path)
    return urls, keys


# (shards, samples per shard, samples per rank): 6 streams (2 ranks x 3 workers) deal the epoch's
# shard order round-robin, stream s = worker * 2 + rank taking positions s, s + 6, ...; with 13
# shards rank 0's streams 0, 2, 4 get 3 + 2 + 2 shards and rank 1's streams 1, 3, 5 get 2 each
@pytest.mark.parametrize("nshards, per_shard, per_rank", [(12, 8, [48, 48]), (13, 5, [35, 30])])
def test_every_sample_once_per_epoch_2_ranks_3_workers(make_shards, nshards, per_shard,
                                                        per_rank):
    pattern, keys = make_shards(nshards, per_shard)
    for epoch in range(2):
        seen = []
        got_per_rank = []
        for rank in range(WORLD):
            ds = ShardDataset(pattern, seed=5, rank=rank, world_size=WORLD).shuffle(20)
            ds.set_epoch(epoch)
            got = _loader_keys(ds, WORKERS)
            got_per_rank.append(got)
            seen += got
        assert Counter(seen) == Counter(keys)  # each exactly once
        assert set(got_per_rank[0]).isdisjoint(got_per_rank[1])
        assert [len(g) for g in got_per_rank] == per_rank


def test_direct_iteration_splits_like_the_plan(twelve):
    pattern, keys = twelve
    shard_of = {k: int(k[1:]) // 8 for k in keys}
    for rank in range(WORLD):
        ds = ShardDataset(pattern, seed=1, rank=rank, world_size=WORLD)
        got = [_key(s) for s in ds]
        shards_read = list(dict.fromkeys(shard_of[k] for k in got))
        order = plan.shard_order(12, seed=1, epoch=0)
        assert shards_read == order[rank::WORLD]


def test_shard_order_and_shuffle_change_per_epoch_and_reproduce(twelve):
    pattern, keys = twelve

    def run(seed, epoch):
        ds = ShardDataset(pattern, seed=seed).shuffle(30)
        ds.set_epoch(epoch)
        return [_key(s) for s in ds]

    e0, e1 = run(3, 0), run(3, 1)
    assert sorted(e0) == sorted(e1) == sorted(keys)
    assert e0 != e1
    assert run(3, 0) == e0 and run(3, 1) == e1  # reproducible from the seed
    assert run(4, 0) != e0
    # shard order alone (no sample shuffle) also changes per epoch
    orders = [plan.shard_order(12, seed=3, epoch=e) for e in range(3)]
    assert all(sorted(o) == list(range(12)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    # samples really are shuffled within the buffer, not only shard-ordered
    unshuffled = [_key(s) for s in ShardDataset(pattern, seed=3)]
    assert e0 != unshuffled and sorted(e0) == sorted(unshuffled)


def test_direct_iteration_advances_epoch(twelve):
    pattern, _ = twelve
    ds = ShardDataset(pattern, seed=2).shuffle(10)
    a = [_key(s) for s in ds]
    assert ds.epoch == 1
    b = [_key(s) for s in ds]
    ref = ShardDataset(pattern, seed=2).shuffle(10)
    ref.set_epoch(1)
    assert b == [_key(s) for s in ref] and a != b


def test_loader_with_workers_is_reproducible(twelve):
    pattern, _ = twelve
    ds = ShardDataset(pattern, seed=9).shuffle(16)
    assert _loader_keys(ds, WORKERS) == _loader_keys(ds, WORKERS)


def test_direct_state_dict_resume(twelve):
    pattern, keys = twelve
    full = [_key(s) for s in ShardDataset(pattern, seed=11).shuffle(25)]
    for stop in (0, 1, 37, 95):
        ds = ShardDataset(pattern, seed=11).shuffle(25)
        it = iter(ds)
        head = [_key(next(it)) for _ in range(stop)]
        state = ds.state_dict()
        it.close()
        resumed = ShardDataset(pattern, seed=11).shuffle(25)
        resumed.load_state_dict(state)
        tail = [_key(s) for s in resumed]
        assert head + tail == full, stop


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_loader_state_dict_resume_at_random_points(twelve, num_workers, stop_and_resume):
    pattern, keys = twelve
    rng = random.Random(1234 + num_workers)

    def make(rank):
        return ShardDataset(pattern, seed=21, rank=rank, world_size=WORLD).shuffle(12)

    for rank in range(WORLD):
        full = _loader_keys(make(rank), num_workers)
        assert len(full) == 48
        for stop in sorted(rng.sample(range(1, len(full)), 3)):
            head, tail, resumed, _ = stop_and_resume(lambda rank=rank: make(rank), num_workers, stop)
            assert Counter(head + tail) == Counter(full), (rank, stop)  # nothing lost or repeated
            assert head + tail == full, (rank, stop)  # and in the same order
            assert resumed.epoch == 1


def test_loader_resume_then_next_epoch_matches(twelve, stop_and_resume):
    pattern, _ = twelve
    make = lambda: ShardDataset(pattern, seed=4).shuffle(8)  # noqa: E731
    ref = ShardLoader(make(), num_workers=2)
    ep0 = [_key(s) for s in ref]
    ep1 = [_key(s) for s in ref]
    head, rest, again, _ = stop_and_resume(make, 2, 50)
    assert head + rest == ep0
    assert [_key(s) for s in again] == ep1 and ep0 != ep1


def test_resume_rejects_mismatched_state(twelve):
    pattern, _ = twelve
    loader = ShardLoader(ShardDataset(pattern, seed=4), num_workers=2)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="workers"):
        ShardLoader(ShardDataset(pattern, seed=4), num_workers=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        ShardLoader(ShardDataset(pattern, seed=5), num_workers=2).load_state_dict(state)


@pytest.mark.parametrize("mode", ["drop", "repeat"])
def test_equalize_gives_every_rank_the_same_count(tmp_path, mode):
    sizes = [3, 9, 4, 12, 5, 7, 2]  # 42 samples, 7 shards: uneven over 2 ranks x 2 workers
    urls, keys = _uneven(tmp_path, sizes)
    for epoch in range(2):
        per_rank = []
        for rank in range(WORLD):
            ds = ShardDataset(urls, seed=8, rank=rank, world_size=WORLD, equalize=mode)
            ds.set_epoch(epoch)
            per_rank.append(_loader_keys(ds, 2))
        # unequalized counts, computed from the plan and the known shard sizes
        raw = []
        for rank in range(WORLD):
            n = 0
            for w in range(2):
                idx = plan.worker_shards(7, seed=8, epoch=epoch, rank=rank, world=WORLD, worker=w,
                                         num_workers=2)
                n += sum(sizes[i] for i in idx)
            raw.append(n)
        assert len(per_rank[0]) == len(per_rank[1])
        seen = Counter(per_rank[0] + per_rank[1])
        if mode == "drop":
            assert max(seen.values()) == 1 and set(seen) <= set(keys)
            assert len(per_rank[0]) <= min(raw)
        else:
            assert set(seen) == set(keys)  # nothing dropped
            assert len(per_rank[0]) >= max(raw)


def test_equalize_uses_index_files(tmp_path):
    from ember.shards.index import write_index

    urls, _ = _uneven(tmp_path, [3, 5, 6])
    for u in urls:
        write_index(u)
    ds = ShardDataset(urls, rank=0, world_size=2, equalize="drop")
    assert ds.ensure_shard_sizes() == [3, 5, 6]
    os.remove(urls[0] + ".idx")
    ds2 = ShardDataset(urls, rank=0, world_size=2, equalize="drop")
    assert ds2.ensure_shard_sizes() == [3, 5, 6]  # scanned


def test_with_epoch_fixed_length(twelve):
    pattern, keys = twelve
    ds = ShardDataset(pattern, seed=0).with_epoch(130)
    got = [_key(s) for s in ds]
    assert len(got) == 130
    assert Counter(got[:96]) == Counter(keys)  # the first pass covers everything once


def test_loader_resume_with_uneven_workers(tmp_path, stop_and_resume):
    """Workers run out at different times (uneven shards); resumption stays exact after that."""
    sizes = [2, 11, 5, 1, 9, 4, 6]
    urls, keys = _uneven(tmp_path, sizes)

    def make():
        return ShardDataset(urls, seed=13, shuffle_shards=False).shuffle(4)

    full = _loader_keys(make(), WORKERS)
    assert Counter(full) == Counter(keys)
    rng = random.Random(99)
    stops = sorted(set(rng.sample(range(1, len(full)), 4)) | {len(full) - 3, len(full) - 1})
    for stop in stops:
        head, tail, _, _ = stop_and_resume(make, WORKERS, stop)
        assert Counter(head + tail) == Counter(full), stop
        assert head + tail == full, stop


# ---- resuming through index files: seek instead of reading and discarding -------------------


def _flat(items) -> list[str]:
    """Sample keys of items that are keys or lists (batches) of keys, in order."""
    out = []
    for item in items:
        out += item if isinstance(item, list) else [item]
    return out


PIPELINES = {
    "shuffle": lambda ds: ds.shuffle(12).map(_key),
    "batched": lambda ds: ds.shuffle(12).map(_key).batched(5, collation_fn=None),
    "decode": lambda ds: ds.decode().map(lambda s: f"{s['__key__']}:{s['cls']}").shuffle(7),
    "with_epoch": lambda ds: ds.shuffle(6).map(_key).with_epoch(50),
    "equalize": lambda ds: ds.shuffle(6).map(_key),
}


def _make(pattern, name, rank=0, world=1):
    equalize = "repeat" if name == "equalize" else None
    ds = ShardDataset(pattern, seed=31, rank=rank, world_size=world, equalize=equalize)
    return PIPELINES[name](ds)


class _Opens:
    """Records where each shard's tar parsing starts: (shard, byte offset of the stream)."""

    def __init__(self, monkeypatch):
        import ember.shards.reading as reading

        self.seen: list[tuple[str, int]] = []
        real = reading.open_tar_source

        def spy(stream, url):
            self.seen.append((url, stream.tell()))
            return real(stream, url)

        monkeypatch.setattr(reading, "open_tar_source", spy)


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("num_workers", [0, 3])
def test_index_resume_equals_uninterrupted_run(make_shards, name, num_workers, stop_and_resume):
    pattern, _ = make_shards(9, 8, index=True)
    world = 2 if name == "equalize" else 1
    rng = random.Random(sorted(PIPELINES).index(name) * 10 + num_workers)
    for rank in range(world):
        full = list(ShardLoader(_make(pattern, name, rank, world), num_workers=num_workers))
        for stop in sorted(rng.sample(range(1, len(full)), 4)):
            head, tail, _, _ = stop_and_resume(lambda r=rank: _make(pattern, name, r, world),
                                               num_workers, stop)
            assert head + tail == full, (rank, stop)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_index_resume_does_not_open_consumed_shards(make_shards, monkeypatch, name):
    pattern, _ = make_shards(9, 8, index=True)
    world = 2 if name == "equalize" else 1
    make = lambda: _make(pattern, name, 0, world)  # noqa: E731
    full = list(ShardLoader(make(), num_workers=0))
    stop = len(full) * 2 // 3
    loader = ShardLoader(make(), num_workers=0)
    head = []
    for item in loader:
        head.append(item)
        if len(head) == stop:
            break
    state = loader.state_dict()
    consumed = {k.split(":")[0] for k in _flat(head)}
    urls = expand_urls(pattern)
    done = {u for i, u in enumerate(urls) if all(f"s{i * 8 + j:05d}" in consumed for j in range(8))}
    assert len(done) >= 2
    opens = _Opens(monkeypatch)

    def resumed_opens():
        opens.seen.clear()
        resumed = ShardLoader(make(), num_workers=0)
        resumed.load_state_dict(state)
        assert list(resumed) == full[stop:]
        return {u for u, _ in opens.seen}

    assert resumed_opens().isdisjoint(done)
    for url in urls:
        os.remove(url + ".idx")
    assert resumed_opens() >= done  # without indexes the consumed shards are read again


def test_index_resume_seeks_to_the_first_unconsumed_sample(make_shards, monkeypatch):
    pattern, keys = make_shards(4, 8, index=True)
    urls = expand_urls(pattern)
    make = lambda: ShardDataset(pattern, shuffle_shards=False)  # noqa: E731
    ds = make()
    it = iter(ds)
    head = [_key(next(it)) for _ in range(21)]  # shards 0 and 1, and 5 samples of shard 2
    state = ds.state_dict()
    it.close()
    opens = _Opens(monkeypatch)
    resumed = make()
    resumed.load_state_dict(state)
    tail = [_key(s) for s in resumed]
    assert head + tail == keys
    with open(urls[2] + ".idx") as f:
        spans = json.load(f)["samples"]
    assert spans[5][0] == keys[21]
    # shards 0 and 1 are not opened; shard 2 is parsed from sample 5's first header on
    assert opens.seen == [(urls[2], spans[5][1]), (urls[3], 0)]


def test_index_resume_never_reads_the_consumed_samples(make_shards):
    """Damage headers inside shards whose samples were all consumed (the size stays the same, so
    the indexes still look current): resuming by reading and discarding would fail there."""
    pattern, _ = make_shards(12, 8, index=True)
    make = lambda: ShardDataset(pattern, seed=2).shuffle(10).map(_key).batched(3, None)  # noqa: E731
    full = _flat(ShardLoader(make(), num_workers=3))
    loader = ShardLoader(make(), num_workers=3)
    head = []
    for batch in loader:
        head += batch
        if len(head) >= 80:
            break
    state = loader.state_dict()
    damaged = 0
    for url in expand_urls(pattern):
        with open(url + ".idx") as f:
            spans = json.load(f)["samples"]
        if all(k in head for k, _, _ in spans):
            with open(url, "r+b") as f:  # the second sample's first header
                f.seek(spans[1][1])
                f.write(b"\xff" * 512)
            damaged += 1
    assert damaged >= 3
    resumed = ShardLoader(make(), num_workers=3)
    resumed.load_state_dict(state)
    assert head + _flat(resumed) == full
    # the damage is real: without the indexes the same resume fails on it
    for url in expand_urls(pattern):
        os.remove(url + ".idx")
    again = ShardLoader(make(), num_workers=3)
    again.load_state_dict(state)
    with pytest.raises(ShardError, match="checksum"):
        list(again)


def _rewrite_shard(url: str, keys: list[str]) -> None:
    """Rewrite a conftest shard (``cls`` and 16-byte ``bin`` per sample) with other keys."""
    with TarWriter(url) as w:
        for i, key in enumerate(keys):
            w.write({"__key__": key, "cls": i % 10, "bin": b"z" * 16})


def _resume_after_rewrite(pattern, new_keys, stop):
    """Stop after ``stop`` samples, rewrite shard 1, resume: (uninterrupted keys over the new
    shards, the resumed keys, warnings)."""
    make = lambda: ShardDataset(pattern, shuffle_shards=False).shuffle(4)  # noqa: E731
    ds = make()
    it = iter(ds)
    for _ in range(stop):
        next(it)
    state = ds.state_dict()
    it.close()
    _rewrite_shard(expand_urls(pattern)[1], new_keys)
    full = [_key(s) for s in make()]
    resumed = make()
    resumed.load_state_dict(state)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        tail = [_key(s) for s in resumed]
    return full, tail, [str(w.message) for w in rec]


def test_stale_index_of_another_size_falls_back_with_a_warning(make_shards):
    pattern, _ = make_shards(3, 8, index=True)
    full, tail, warned = _resume_after_rewrite(pattern, [f"n{i}" for i in range(11)], 19)
    assert tail == full[19:]
    url = expand_urls(pattern)[1]
    assert any(f"ignoring stale index {url}.idx" in w for w in warned), warned


def test_stale_index_of_the_same_size_falls_back_with_a_warning(make_shards):
    pattern, keys = make_shards(3, 8, index=True)
    url = expand_urls(pattern)[1]
    size = os.path.getsize(url)
    # same number of samples, same key lengths and field sizes: only the keys differ
    new_keys = [k.replace("s", "x") for k in keys[8:16]]
    full, tail, warned = _resume_after_rewrite(pattern, new_keys, 19)
    assert os.path.getsize(url) == size
    assert tail == full[19:]
    assert set(new_keys) <= set(full)  # the uninterrupted run reads the new keys
    assert any(f"index {url}.idx does not match shard {url}" in w for w in warned), warned


@pytest.mark.parametrize("reason", ["select", "gzip", "no index"])
def test_resume_without_a_usable_index_reads_and_discards(make_shards, tmp_path, monkeypatch,
                                                          reason):
    if reason == "gzip":
        urls = []
        for i in range(3):
            path = str(tmp_path / f"z-{i}.tar.gz")
            with TarWriter(path) as w:
                for j in range(8):
                    w.write({"__key__": f"z{i}_{j}", "cls": j})
            write_index(path)
            urls.append(path)
        pattern = urls
    else:
        pattern, _ = make_shards(3, 8, index=reason != "no index")
    make = lambda: (ShardDataset(pattern, shuffle_shards=False)  # noqa: E731
                    .select(lambda s: int(s["cls"]) % 3 != 1))
    full = [_key(s) for s in make()]
    ds = make()
    it = iter(ds)
    head = [_key(next(it)) for _ in range(9)]
    state = ds.state_dict()
    it.close()
    opens = _Opens(monkeypatch)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [_key(s) for s in resumed] == full
    assert [u for u, _ in opens.seen] == expand_urls(pattern)  # every shard, from its start
    assert all(at == 0 for _, at in opens.seen)


def test_error_after_a_seek_names_the_absolute_offset(make_shards):
    pattern, keys = make_shards(2, 8, index=True)
    url = expand_urls(pattern)[0]
    with open(url + ".idx") as f:
        spans = json.load(f)["samples"]
    ds = ShardDataset(pattern, shuffle_shards=False)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    it.close()
    bad_at = spans[6][1]
    with open(url, "r+b") as f:
        f.seek(bad_at)
        f.write(b"\xff" * 512)
    resumed = ShardDataset(pattern, shuffle_shards=False)
    resumed.load_state_dict(state)
    got = []
    with pytest.raises(ShardError, match="checksum") as ei:
        for s in resumed:
            got.append(_key(s))
    assert got == keys[3:5]  # sample 5 is dropped: its end cannot be known
    assert ei.value.url == url and ei.value.offset == bad_at


def test_truncation_message_after_a_seek_quotes_absolute_offsets(make_shards):
    from ember.shards.reading import _shard_from

    pattern, keys = make_shards(2, 8, index=True)
    url = expand_urls(pattern)[0]
    with open(url + ".idx") as f:
        spans = json.load(f)["samples"]
    header = spans[6][1]
    cut = header + 512 + 5  # inside the data of sample 6's first member, its header intact
    with open(url, "r+b") as f:
        f.truncate(cut)
    got = []
    with pytest.raises(ShardError, match="inside the data") as ei:
        for s in _shard_from(url, spans[3][1]):  # entered at sample 3, as a resume does
            got.append(s["__key__"])
    assert got == keys[3:6]  # the samples before the cut member are complete
    assert ei.value.offset == cut
    message = str(ei.value)
    assert f"at byte {cut}:" in message and f"(header at byte {header})" in message, message
