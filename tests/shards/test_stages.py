"""ember.shards.stages.default_collate: torch's collation conventions, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate as torch_collate

from ember.shards.stages import default_collate


def _same(a, b) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def test_matches_torch_default_collate_on_typical_items():
    items = [(torch.full((2, 3), float(i)), i, i / 2, np.arange(4) + i, f"s{i}",
              {"label": i, "score": i * 0.5, "name": f"n{i}"}) for i in range(5)]
    want = torch_collate(items)
    # torch gives a list of columns and a column of strings as a tuple (a dict's as a list);
    # ember keeps the items' tuple and gives every column of strings as a list
    want[4] = list(want[4])
    _same(default_collate(items), tuple(want))


def test_dicts_with_different_keys_name_the_missing_key():
    items = [{"a": 1, "b": 2}, {"a": 3}]
    with pytest.raises(ValueError, match=r"item 1 .*'b'.*collation_fn"):
        default_collate(items)


def test_tuples_of_different_lengths_are_named():
    with pytest.raises(ValueError, match=r"item 2 has 3 fields, item 0 has 2.*collation_fn"):
        default_collate([(1, 2), (3, 4), (5, 6, 7)])


def test_a_stage_class_with_a_name_becomes_a_fluent_method(tmp_path):
    from ember.shards import ShardDataset, ShardWriter
    from ember.shards import stages as stage_module

    class _Twice(stage_module.Stage):
        name = "twice_for_test"
        one_to_one = True

        def __init__(self, field: str):
            self.field = field

        def apply(self, src, ctx, index):
            for sample in src:
                yield {**sample, self.field: sample[self.field] * 2}

    try:
        url = str(tmp_path / "t.tar")
        with ShardWriter(url.replace("t.tar", "t-%d.tar"), maxcount=10) as w:
            for i in range(3):
                w.write({"__key__": f"k{i}", "txt": f"{i}".encode()})
        ds = ShardDataset(str(tmp_path / "t-0.tar")).twice_for_test("txt")
        assert [s["txt"] for s in ds] == [b"00", b"11", b"22"]
        assert ShardDataset.twice_for_test.__name__ == "twice_for_test"
    finally:
        stage_module.REGISTRY.pop("twice_for_test", None)
        delattr(ShardDataset, "twice_for_test")


def _extract_samples(tmp_path):
    import webdataset as wds

    url = str(tmp_path / "x.tar")
    with wds.TarWriter(url) as w:
        for i in range(4):
            sample = {"__key__": f"s{i}", "cls": i, "txt": f"t{i}"}
            sample["jpg" if i % 2 else "png"] = b"img%d" % i
            if i == 3:
                sample["seg.png"] = b"mask"
            w.write(sample)
    return url


@pytest.mark.parametrize("patterns, kw", [
    (("png;jpg", "cls"), {}),
    (("*.png", "txt"), {"ignore_missing": True}),
    (("*png;jpg", "__key__"), {"duplicate_is_error": False}),
    ((["cls", "txt"],), {"duplicate_is_error": False}),
])
def test_extract_keys_matches_webdataset(tmp_path, patterns, kw):
    from webdataset.filters import extract_keys

    from ember.shards import ShardDataset

    url = _extract_samples(tmp_path)
    raw = list(ShardDataset(url))
    expected = list(extract_keys(*patterns, **kw)(iter(raw)))
    assert list(ShardDataset(url).extract_keys(*patterns, **kw)) == expected
    assert len(expected) == 4


def test_extract_keys_errors_as_webdataset_and_through_handler(tmp_path):
    from webdataset.filters import extract_keys

    from ember.shards import ShardDataset, ignore_and_continue

    url = _extract_samples(tmp_path)
    raw = list(ShardDataset(url))
    for patterns in (("jpg",), ("*png",)):  # missing in some samples; two fields in s3
        with pytest.raises(ValueError):
            list(extract_keys(*patterns)(iter(raw)))
        with pytest.raises(ValueError, match="extract_keys"):
            list(ShardDataset(url).extract_keys(*patterns))
    ds = ShardDataset(url, on_error="skip").extract_keys("jpg", handler=ignore_and_continue)
    assert list(ds) == [(b"img1",), (b"img3",)] and ds.error_count == 2
    with pytest.raises(TypeError, match="extract_keys"):
        ShardDataset(url).extract_keys(3)


def test_extract_keys_resumes_exactly_through_indexes(tmp_path):
    from ember.shards import ShardDataset
    from ember.shards.index import write_index

    url = _extract_samples(tmp_path)
    write_index(url)

    def make():
        return ShardDataset([url], seed=2).shuffle(3).extract_keys("txt", "cls")

    full = list(make())
    for stop in range(1, 4):
        ds = make()
        it = iter(ds)
        head = [next(it) for _ in range(stop)]
        state = ds.state_dict()
        again = make()
        again.load_state_dict(state)
        assert head + list(again) == full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_user_stage_that_reads_its_items_resumes_exactly_over_indexed_shards(
        make_shards, stop_and_resume, num_workers):
    """A Stage subclass declares nothing about its items: it is taken to read them, so a
    resumed stream never hands it the placeholders of the index-based seek."""
    from ember.shards import ShardDataset
    from ember.shards import stages as stage_module

    class _Both(stage_module.Stage):
        name = "both_halves_for_test"

        def apply(self, src, ctx, index):
            for sample in src:
                yield sample["__key__"] + "/1"
                yield sample["__key__"] + "/2"

    try:
        pattern, _ = make_shards(4, 9, index=True)
        make = lambda: ShardDataset(pattern, seed=1, nodesplitter=None).shuffle(5) \
            .both_halves_for_test()
        from ember.shards import ShardLoader

        full = list(ShardLoader(make(), num_workers=num_workers))
        assert len(full) == 72
        for stop in (1, 13, 40):
            head, rest, _, _ = stop_and_resume(make, num_workers, stop)
            assert head + rest == full
    finally:
        stage_module.REGISTRY.pop("both_halves_for_test", None)
        delattr(ShardDataset, "both_halves_for_test")


def test_built_in_stages_that_never_read_items_keep_the_index_based_resume():
    from ember.shards import stages as stage_module

    count_free = [stage_module.Shuffle(4), stage_module.RSample(0.5), stage_module.Slice(3),
                  stage_module.Batched(2), stage_module.Unbatched(),
                  stage_module.Map(len), stage_module.MapDict({"a": len}),
                  stage_module.MapTuple((len,)), stage_module.Rename({"a": "b"}),
                  stage_module.ToTuple(("a",)), stage_module.ExtractKeys.build("a"),
                  stage_module.Decode(dict)]
    assert [s.name for s in count_free if s.counts_depend_on_content("raise")] == []
    reads = [stage_module.Select(bool), stage_module.Map(len, handler=bool),
             stage_module.Decode(dict, handler=bool)]
    assert all(s.counts_depend_on_content("raise") for s in reads)
    assert stage_module.Decode(dict).counts_depend_on_content("skip")

    class _Plain(stage_module.Stage):
        pass

    assert _Plain().counts_depend_on_content("raise")
