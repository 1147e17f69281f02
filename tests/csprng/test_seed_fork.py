"""g.seed() re-seeds from the OS and keeps the generator fork-safe; manual_seed stays deterministic."""

import os
import pickle
import sys

import pytest
import torch

import ember.csprng as csprng

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32",
                                reason="needs os.fork")


def _in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.write(w, pickle.dumps(fn()))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(data)


def _draw(g):
    return torch.randint(-(2**63), 2**63 - 1, (8,), generator=g).tolist()


@pytest.mark.parametrize("make", [csprng.create_random_device_generator,
                                  lambda: csprng.create_generator(5)])
def test_fork_after_seed_gives_different_streams(make):
    g = make()
    seed = g.seed()
    child, child_seed = _in_child(lambda: (_draw(g), g.initial_seed()))
    parent = _draw(g)
    assert child != parent
    assert child_seed != seed and g.initial_seed() == seed
    # the returned seed still repeats the parent's stream deterministically
    assert _draw(csprng.create_generator(seed)) == parent


def test_manual_seed_is_deterministic_across_fork_like_torch():
    g = csprng.create_random_device_generator()
    g.manual_seed(9)
    child = _in_child(lambda: _draw(g))
    assert child == _draw(g)
    t = torch.Generator().manual_seed(9)
    assert _in_child(lambda: torch.rand(3, generator=t).tolist()) == torch.rand(3, generator=t).tolist()


def test_seed_keeps_pickling_refused():
    g = csprng.create_generator(1)
    g.seed()
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(g)
