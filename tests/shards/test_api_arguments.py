"""Numeric arguments of the ShardDataset / ShardLoader API are checked as torch checks its
functions' arguments: a value of the wrong type is a TypeError, one out of range a
ValueError, and the message names the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.shards import ShardDataset, ShardLoader


def test_torch_refuses_a_float_count_with_a_type_error():
    # the convention followed: torch's argument parser refuses a float where an int is expected
    with pytest.raises(TypeError):
        torch.randperm(2.5)


@pytest.mark.parametrize("call, error, name", [
    (lambda ds: ds.shuffle(-5), ValueError, "bufsize"),
    (lambda ds: ds.shuffle(2.5), TypeError, "bufsize"),
    (lambda ds: ds.shuffle("10"), TypeError, "bufsize"),
    (lambda ds: ds.shuffle(10, initial=-1), ValueError, "initial"),
    (lambda ds: ds.batched(2.5), TypeError, "batchsize"),
    (lambda ds: ds.batched(0), ValueError, "batchsize"),
    (lambda ds: ds.batched(True), TypeError, "batchsize"),
    (lambda ds: ShardLoader(ds).batched(2.5), TypeError, "batchsize"),
    (lambda ds: ShardLoader(ds).shuffle(-1), ValueError, "bufsize"),
    (lambda ds: ShardDataset("a.tar", seed=1.5), TypeError, "seed"),
    (lambda ds: ShardDataset("a.tar", seed="1"), TypeError, "seed"),
])
def test_bad_numbers_are_refused_naming_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call(ShardDataset("a.tar"))


def test_integer_types_are_accepted():
    ds = ShardDataset("a.tar", seed=np.int64(3)).shuffle(np.int32(5)).batched(np.int64(2))
    assert ds.seed == 3 and type(ds.seed) is int
    assert ShardDataset("a.tar").shuffle(0).stages[-1].bufsize == 0  # 0: no shuffling, as before


@pytest.mark.parametrize("call, error, name", [
    (lambda ds: ds.with_length(2.5), TypeError, "n"),
    (lambda ds: ds.with_length(-1), ValueError, "n"),
    (lambda ds: ds.with_epoch(2.5), TypeError, "n"),
    (lambda ds: ds.with_epoch(0), ValueError, "n"),
    (lambda ds: ds.slice(2.5), TypeError, "stop"),
    (lambda ds: ds.slice(0.5, 4), TypeError, "start"),
    (lambda ds: ds.slice(0, 4, 1.5), TypeError, "step"),
    (lambda ds: ds.slice(0, 4, 0), ValueError, "step"),
    (lambda ds: ds.set_epoch(1.5), TypeError, "epoch"),
    (lambda ds: ds.set_epoch(-1), ValueError, "epoch"),
    (lambda ds: ds.rsample("0.5"), TypeError, "p"),
    (lambda ds: ds.rsample(float("nan")), ValueError, "p"),
    (lambda ds: ds.rsample(1.5), ValueError, "p"),
    (lambda ds: ShardDataset("a.tar", rank=0.5, world_size=2), TypeError, "rank"),
    (lambda ds: ShardDataset("a.tar", rank=0, world_size=2.5), TypeError, "world_size"),
    (lambda ds: ShardDataset("a.tar", rank=0, world_size=0), ValueError, "world_size"),
    (lambda ds: ShardDataset("a.tar", rank=-1), ValueError, "rank"),
    (lambda ds: ShardDataset("a.tar", timeout="5"), TypeError, "timeout"),
    (lambda ds: ShardDataset("a.tar", timeout=0), ValueError, "timeout"),
    (lambda ds: ShardDataset("a.tar", timeout=float("nan")), ValueError, "timeout"),
    (lambda ds: ShardDataset("a.tar", retries=2.5), TypeError, "retries"),
    (lambda ds: ShardDataset("a.tar", retries=-1), ValueError, "retries"),
    (lambda ds: ShardDataset("a.tar", cache_dir="c", cache_size=1.5), TypeError, "cache_size"),
    (lambda ds: ShardDataset("a.tar", cache_dir="c", cache_size=-1), ValueError, "cache_size"),
    (lambda ds: ShardDataset("a.tar", shard_sizes=[2.5]), TypeError, "shard_sizes"),
    (lambda ds: ShardDataset("a.tar", shard_sizes=[-1]), ValueError, "shard_sizes"),
    (lambda ds: ShardLoader(ds, num_workers=2.5), TypeError, "num_workers"),
    (lambda ds: ShardLoader(ds, num_workers=-1), ValueError, "num_workers"),
    (lambda ds: ShardLoader(ds, transfer_memory=1.5), TypeError, "transfer_memory"),
    (lambda ds: ShardLoader(ds, num_workers=1, transfer_group=2.5), TypeError, "transfer_group"),
    (lambda ds: ShardLoader(ds, batch_size=2.5), TypeError, "batch_size"),
    (lambda ds: ShardLoader(ds, batch_size=0), ValueError, "batch_size"),
    (lambda ds: ShardLoader(ds).with_length(2.5), TypeError, "n"),
    (lambda ds: ShardLoader(ds).set_epoch(1.5), TypeError, "epoch"),
])
def test_every_count_and_number_is_checked_naming_the_argument(call, error, name):
    # found by an audit: these took int(2.5) == 2 silently
    with pytest.raises(error, match=rf"\b{name}\b"):
        call(ShardDataset("a.tar"))


def test_checked_arguments_keep_working_with_numpy_and_plain_values():
    ds = ShardDataset("a.tar", rank=np.int64(1), world_size=2, timeout=5, retries=0,
                      shard_sizes=[np.int32(3)])
    assert (ds.rank, ds.world_size, ds.shard_sizes) == (1, 2, [3])
    ds = ds.with_length(np.int64(4)).with_epoch(3).slice(1, None, 2).rsample(np.float32(0.5))
    sliced = ds.stages[-2]
    assert ds.length == 4 and ds.epoch_length == 3
    assert (sliced.start, sliced.stop, sliced.step) == (1, None, 2)
    loader = ShardLoader(ds, num_workers=np.int64(0), transfer_memory=0).with_length(2)
    assert loader.num_workers == 0 and len(loader) == 2


def test_url_options_replace_the_url_keywords_which_still_work_deprecated(tmp_path):
    from ember.shards import UrlOptions

    options = UrlOptions(timeout=5, retries=0, headers={"X-A": "1"}, cache_dir=tmp_path)
    ds = ShardDataset("a.tar", url_options=options)
    assert ds.options == options and ds.options.cache_dir == str(tmp_path)
    with pytest.warns(DeprecationWarning, match="url_options="):
        old = ShardDataset("a.tar", timeout=5, retries=0, cache_dir=tmp_path)
    assert old.options == UrlOptions(timeout=5, retries=0, cache_dir=str(tmp_path))
    with pytest.raises(TypeError, match="inside url_options="):
        ShardDataset("a.tar", url_options=options, timeout=1)
    with pytest.raises(TypeError, match="'colour'"):
        ShardDataset("a.tar", colour=1)
    with pytest.raises(TypeError, match="url_options must be a UrlOptions"):
        ShardDataset("a.tar", url_options={"timeout": 1})
    with pytest.raises(TypeError, match="headers"):
        UrlOptions(headers={"X-A": 1})
    with pytest.raises(ValueError, match="backoff"):
        UrlOptions(backoff=-1)
    # hashable, as a frozen dataclass is, headers and all
    assert hash(UrlOptions(headers={"a": "1"})) == hash(UrlOptions(headers={"a": "1"}))


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_allow_pipe_takes_only_a_bool(value, tmp_path):
    from ember.shards import UrlOptions

    with pytest.raises(TypeError, match=r"\ballow_pipe\b"):
        UrlOptions(allow_pipe=value)
    assert UrlOptions(allow_pipe=True).allow_pipe is True
    assert UrlOptions(allow_pipe=False).allow_pipe is False


def test_allow_pipe_takes_numpys_bools_as_bools():
    import numpy as np

    from ember.shards import UrlOptions

    assert UrlOptions(allow_pipe=np.True_).allow_pipe is True
    assert UrlOptions(allow_pipe=np.False_).allow_pipe is False


@pytest.mark.parametrize("value", [float("inf"), 1e12, 86400.5])
def test_a_timeout_no_socket_can_wait_is_refused(value):
    from ember.shards import UrlOptions

    with pytest.raises(ValueError, match=r"\btimeout\b"):
        UrlOptions(timeout=value)


def test_timeout_none_waits_without_limit(make_shards):
    from ember.shards import UrlOptions

    pattern, keys = make_shards(1, 3)
    options = UrlOptions(timeout=None)
    assert options.timeout is None and UrlOptions(timeout=86400).timeout == 86400.0
    assert [s["__key__"] for s in ShardDataset(pattern, url_options=options)] == keys
