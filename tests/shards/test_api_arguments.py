"""Numeric arguments of the ShardDataset / ShardLoader API are checked as torch checks its
functions' arguments (issue 26): a value of the wrong type is a TypeError, one out of range a
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
    assert ShardDataset("a.tar").shuffle(0).stages[-1][1][0] == 0  # 0: no shuffling, as before
