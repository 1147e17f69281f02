"""handler= on map/map_dict/map_tuple/to_tuple/decode (webdataset's handler semantics, checked
against webdataset itself on shards it wrote), map_tuple, slice and rsample, with exact resume."""

from __future__ import annotations

import itertools
import random
import warnings

import pytest
import webdataset as wds

import ember.shards as es
from ember.shards import ShardDataset, ShardLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N_SHARDS, PER_SHARD = 4, 10


def _wds_shards(tmp_path):
    """Shards written by webdataset's TarWriter: every 7th sample has no ``txt`` field."""
    urls = []
    for i in range(N_SHARDS):
        url = str(tmp_path / f"h-{i:03d}.tar")
        with wds.TarWriter(url) as w:
            for j in range(PER_SHARD):
                n = i * PER_SHARD + j
                sample = {"__key__": f"k{n:03d}", "cls": n}
                if n % 7:
                    sample["txt"] = f"t{n}"
                w.write(sample)
        urls.append(url)
    return urls


def _bad_every_3(x):
    n = int(x["cls"]) if isinstance(x, dict) else int(x)
    if n % 3 == 0:
        raise ValueError(f"bad {n}")
    return n


def _wds(urls):
    return wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)


def test_handlers_are_exported_under_webdataset_names():
    for name in ("reraise_exception", "warn_and_continue", "ignore_and_continue",
                 "warn_and_stop"):
        assert callable(getattr(es, name))
    exc = ValueError("x")
    with pytest.raises(ValueError):
        es.reraise_exception(exc)
    assert es.ignore_and_continue(exc) is True
    with pytest.warns(UserWarning, match="ValueError: x"):
        assert es.warn_and_continue(exc) is True
    with pytest.warns(UserWarning):
        assert es.warn_and_stop(exc) is False


@pytest.mark.parametrize("stage", ["map", "map_dict", "map_tuple", "to_tuple", "decode"])
def test_handler_on_each_stage_matches_webdataset(tmp_path, stage):
    urls = _wds_shards(tmp_path)
    ours = ShardDataset(urls, shuffle_shards=False)
    theirs = _wds(urls)
    h = es.ignore_and_continue
    if stage == "map":
        ours, theirs = ours.map(_bad_every_3, handler=h), theirs.map(_bad_every_3, handler=h)
    elif stage == "map_dict":
        ours = ours.decode().map_dict(cls=_bad_every_3, handler=h).to_tuple("__key__", "cls")
        theirs = theirs.decode().map_dict(cls=_bad_every_3, handler=h).to_tuple("__key__", "cls")
    elif stage == "map_tuple":
        ours = ours.decode().to_tuple("__key__", "cls").map_tuple(None, _bad_every_3, handler=h)
        theirs = theirs.decode().to_tuple("__key__", "cls").map_tuple(lambda k: k, _bad_every_3,
                                                                       handler=h)
    elif stage == "to_tuple":  # samples without txt are skipped, not KeyError
        ours = ours.decode().to_tuple("__key__", "txt", handler=h)
        theirs = theirs.decode().to_tuple("__key__", "txt", handler=h)
    else:  # a decoding handler that raises (webdataset passes ".cls", ember "cls")
        def boom(key, data):
            if key.lstrip(".") == "cls" and int(data) % 5 == 0:
                raise ValueError("cannot decode")
            return None

        ours = ours.decode(boom, handler=h).to_tuple("__key__", "cls")
        theirs = theirs.decode(boom, handler=h).to_tuple("__key__", "cls")
    got = list(ours)
    want = [tuple(x) if isinstance(x, (tuple, list)) else x for x in theirs]
    assert got == want and len(got) > N_SHARDS * PER_SHARD // 2
    skipped = N_SHARDS * PER_SHARD - len(got)
    assert skipped > 0
    assert ours.error_count == skipped  # the skipped items are counted


def test_handler_default_raises_and_warn_stop_and_callable(tmp_path):
    urls = _wds_shards(tmp_path)
    with pytest.raises(ValueError, match="bad 0"):
        list(ShardDataset(urls, shuffle_shards=False).map(_bad_every_3))
    with pytest.raises(ValueError, match="bad 0"):
        list(ShardDataset(urls, shuffle_shards=False).map(_bad_every_3,
                                                          handler=es.reraise_exception))
    with pytest.warns(UserWarning, match="stream stopped"):
        got = list(ShardDataset(urls, shuffle_shards=False).select(lambda s: s["cls"] != b"0")
                   .map(_bad_every_3, handler=es.warn_and_stop))
    assert got == [1, 2]  # stopped at 3, as webdataset's warn_and_stop
    seen = []

    def mine(exc):
        seen.append(str(exc))
        return len(seen) < 3  # skip two, then stop

    got = list(ShardDataset(urls, shuffle_shards=False).map(_bad_every_3, handler=mine))
    assert got == [1, 2, 4, 5] and seen == ["bad 0", "bad 3", "bad 6"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = ShardDataset(urls, shuffle_shards=False).map(_bad_every_3,
                                                         handler=es.warn_and_continue)
        assert len(list(ds)) == 26 and ds.error_count == 14
    assert sum("bad" in str(x.message) for x in w) == 14
    with pytest.raises(TypeError, match="handler="):
        ShardDataset(urls).map(_bad_every_3, handler="skip")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_handler_resume_is_exact_and_errors_in_state(tmp_path, stop_and_resume, num_workers):
    urls = _wds_shards(tmp_path)

    def make():
        return (ShardDataset(urls, seed=5).shuffle(8).decode()
                .map_dict(cls=_bad_every_3, handler=es.ignore_and_continue)
                .to_tuple("__key__", "txt", handler=es.ignore_and_continue)
                .map_tuple(None, str.upper).map(lambda t: t[0]))

    full = [k for k in ShardLoader(make(), num_workers=num_workers)]
    rng = random.Random(num_workers)
    for stop in sorted(rng.sample(range(1, len(full)), 3)):
        head, rest, resumed, state = stop_and_resume(make, num_workers, stop)
        assert head + rest == full
        assert "errors" in state and sum(state["errors"]) > 0
    loader = ShardLoader(make(), num_workers=num_workers)
    assert len(list(loader)) == len(full)
    assert loader.error_count == N_SHARDS * PER_SHARD - len(full)


def _counting_pipeline(urls):
    return (ShardDataset(urls, seed=5).shuffle(8).decode()
            .map_dict(cls=_bad_every_3, handler=es.ignore_and_continue)
            .to_tuple("__key__", "txt", handler=es.ignore_and_continue)
            .map(lambda t: t[0]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_count_continues_after_resume(tmp_path, num_workers):
    """A resumed loader reports the errors of the whole epoch, as the uninterrupted one does."""
    urls = _wds_shards(tmp_path)
    loader = ShardLoader(_counting_pipeline(urls), num_workers=num_workers)
    counts = []
    for _ in loader:
        counts.append(loader.error_count)
    total = loader.error_count
    assert total == N_SHARDS * PER_SHARD - len(counts) and total > 0
    for stop in (1, len(counts) // 2, len(counts) - 1):
        first = ShardLoader(_counting_pipeline(urls), num_workers=num_workers)
        for i, _ in enumerate(first, 1):
            if i == stop:
                break
        state = first.state_dict()
        assert sum(state["errors"]) == counts[stop - 1]
        resumed = ShardLoader(_counting_pipeline(urls), num_workers=num_workers)
        resumed.load_state_dict(state)
        assert resumed.error_count == counts[stop - 1]  # before the first item arrives
        after = []
        for _ in resumed:
            after.append(resumed.error_count)
        assert after == counts[stop:]
        assert resumed.error_count == total


def test_error_count_continues_after_resume_of_direct_iteration(tmp_path):
    urls = _wds_shards(tmp_path)
    ds = _counting_pipeline(urls)
    counts = [ds.error_count for _ in ds]
    stop = len(counts) // 3
    first = _counting_pipeline(urls)
    for i, _ in enumerate(first, 1):
        if i == stop:
            break
    state = first.state_dict()
    assert state["errors"] == [counts[stop - 1]]
    resumed = _counting_pipeline(urls)
    resumed.load_state_dict(state)
    assert [resumed.error_count for _ in resumed] == counts[stop:]


def test_error_counts_in_state_are_checked(tmp_path):
    urls = _wds_shards(tmp_path)
    loader = ShardLoader(_counting_pipeline(urls), num_workers=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="errors"):
        loader.load_state_dict({**state, "errors": [1, 2]})
    with pytest.raises(ValueError, match="errors"):
        loader.load_state_dict({**state, "errors": [-1]})
    old = {k: v for k, v in state.items() if k != "errors"}  # a state from before the key
    loader.load_state_dict(old)
    assert len(list(loader)) > 0 and loader.error_count > 0


def test_map_tuple_matches_webdataset_and_checks_arity(tmp_path):
    urls = _wds_shards(tmp_path)
    ours = ShardDataset(urls, shuffle_shards=False).decode().to_tuple("__key__", "cls") \
        .map_tuple(str.upper, lambda c: c * 2)
    theirs = _wds(urls).decode().to_tuple("__key__", "cls").map_tuple(str.upper, lambda c: c * 2)
    assert list(ours) == [tuple(x) for x in theirs]
    with pytest.raises(ValueError, match="map_tuple with 1 functions got an item of type tuple "
                                         "with 2 elements"):
        list(ShardDataset(urls).decode().to_tuple("__key__", "cls").map_tuple(str.upper))
    with pytest.raises(TypeError, match="map_tuple"):
        ShardDataset(urls).map_tuple(3)


@pytest.mark.parametrize("args", [(5,), (3, 17), (2, None, 3), (0, 40, 7)])
def test_slice_is_islice_on_the_stream(tmp_path, args):
    urls = _wds_shards(tmp_path)
    base = ShardDataset(urls, seed=1).shuffle(6).map(lambda s: s["__key__"])
    assert list(base.slice(*args)) == list(itertools.islice(iter(base), *args))
    with pytest.raises(ValueError, match="slice"):
        base.slice(-1)
    with pytest.raises(ValueError, match="slice"):
        base.slice(0, 4, 0)


def test_slice_and_rsample_resume_exactly(tmp_path, stop_and_resume):
    urls = _wds_shards(tmp_path)

    def make():
        return ShardDataset(urls, seed=2).shuffle(5).rsample(0.6).slice(1, 18, 2) \
            .map(lambda s: s["__key__"])

    full = list(ShardLoader(make(), num_workers=2))
    assert 0 < len(full) <= 16
    for stop in (1, len(full) // 2, len(full) - 1):
        head, rest, _, _ = stop_and_resume(make, 2, stop)
        assert head + rest == full


def test_rsample_keeps_p_of_the_items_reproducibly(tmp_path):
    urls = _wds_shards(tmp_path)
    keys = [s["__key__"] for s in ShardDataset(urls, shuffle_shards=False)]

    def kept(p, seed=0, epoch=0):
        ds = ShardDataset(urls * 25, shuffle_shards=False, seed=seed).rsample(p) \
            .map(lambda s: s["__key__"])
        ds.set_epoch(epoch)
        return list(ds)

    assert kept(0.0) == [] and kept(1.0) == keys * 25
    a = kept(0.3)
    assert a == kept(0.3)  # same seed and epoch: same draws
    assert a != kept(0.3, seed=1) and a != kept(0.3, epoch=1)
    # 1000 Bernoulli(0.3) draws: mean 300, sd ~14.5; 5 sd either side
    assert 227 < len(a) < 373
    assert all(x in keys for x in a)
    with pytest.raises(ValueError, match="probability"):
        ShardDataset(urls).rsample(1.5)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_slice_and_rsample_resume_through_indexes(make_shards, stop_and_resume, num_workers):
    pattern, _ = make_shards(5, 12, index=True)

    def make():
        return ShardDataset(pattern, seed=9).rsample(0.7).shuffle(6).slice(2, None, 1) \
            .map(lambda s: s["__key__"])

    full = list(ShardLoader(make(), num_workers=num_workers))
    assert 20 < len(full) < 60
    for stop in (3, len(full) // 2, len(full) - 2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fall-back to read-and-discard
            head, rest, _, _ = stop_and_resume(make, num_workers, stop)
        assert head + rest == full


def test_decode_handler_skips_corrupt_images_like_webdataset(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    import io

    urls = []
    for i in range(2):
        url = str(tmp_path / f"img-{i}.tar")
        with wds.TarWriter(url) as w:
            for j in range(12):
                b = io.BytesIO()
                Image.new("RGB", (4, 4), (j, i, 0)).save(b, "PNG")
                w.write({"__key__": f"{j:03d}", "png": b.getvalue() if j % 4 else b"not a png",
                         "cls": i * 100 + j})
        urls.append(url)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ShardDataset(urls, shuffle_shards=False) \
            .decode("torchrgb", handler=wds.warn_and_continue).to_tuple("png", "cls")
        theirs = _wds(urls).decode("torchrgb", handler=wds.warn_and_continue) \
            .to_tuple("png", "cls")
        got = [(x.tolist(), c) for x, c in ours]
        want = [(x.tolist(), c) for x, c in theirs]
        assert got == want and len(got) == 18 and ours.error_count == 6
        loader = ShardLoader(ours.batched(3), num_workers=2)
        batches = list(loader)
    assert sorted(c for _, cs in batches for c in cs.tolist()) == sorted(c for _, c in got)
    assert loader.error_count == 6 and loader.state_dict()["errors"] == [3, 3]
