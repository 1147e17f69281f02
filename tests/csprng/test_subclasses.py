"""Draws into tensor subclasses: the values reach the subclass's own data, or the draw is refused
where torch refuses it; never a silent write into memory the subclass does not read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ember.csprng as csprng

two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
TwoTensor = two_tensor.TwoTensor


def _plain(draw, n: int = 4) -> torch.Tensor:
    """What ``draw(plain tensor, generator)`` gives with a generator seeded as the test's."""
    return draw(torch.zeros(n), csprng.create_generator(0))


def _normal(t: torch.Tensor, g) -> torch.Tensor:
    return t.normal_(generator=g)


def _init_normal(t: torch.Tensor, g) -> torch.Tensor:
    return torch.nn.init.normal_(t, generator=g)


def _kaiming(t: torch.Tensor, g) -> torch.Tensor:
    return torch.nn.init.kaiming_uniform_(t.view(2, 2), generator=g)


def _exponential(t: torch.Tensor, g) -> torch.Tensor:
    return t.exponential_(generator=g)


def _random(t: torch.Tensor, g) -> torch.Tensor:
    return t.random_(3, 9, generator=g)


@pytest.mark.parametrize("draw", [_normal, _init_normal, _exponential, _random],
                         ids=lambda f: f.__name__)
def test_in_place_draw_into_a_wrapper_subclass_fills_its_inner_tensors(draw):
    # torch fills TwoTensor's inner tensors through its __torch_dispatch__; ember's values get
    # there too (one draw, copied into both), where before nothing was written
    t = TwoTensor(torch.zeros(4), torch.zeros(4))
    assert t.data_ptr() == 0  # no storage of its own
    out = draw(t, csprng.create_generator(0))
    assert out is t
    expected = _plain(draw)
    assert torch.equal(t.a, expected) and torch.equal(t.b, expected)
    torch_filled = draw(TwoTensor(torch.zeros(4), torch.zeros(4)), torch.Generator().manual_seed(0))
    assert bool((torch_filled.a != 0).all()) and bool((t.a != 0).all())


def test_kaiming_uniform_into_a_wrapper_subclass_parameter():
    w = TwoTensor(torch.zeros(2, 2), torch.zeros(2, 2))
    torch.nn.init.kaiming_uniform_(w, generator=csprng.create_generator(0))
    expected = torch.nn.init.kaiming_uniform_(torch.zeros(2, 2), generator=csprng.create_generator(0))
    assert torch.equal(w.a, expected) and torch.equal(w.b, expected)


@pytest.mark.parametrize("factory", [torch.rand_like, torch.randn_like])
def test_like_factories_of_a_wrapper_subclass_return_drawn_values(factory):
    r = factory(TwoTensor(torch.zeros(4), torch.zeros(4)), generator=csprng.create_generator(0))
    assert type(r) is TwoTensor
    expected = factory(torch.zeros(4), generator=csprng.create_generator(0))
    assert torch.equal(r.a, expected) and torch.equal(r.b, expected)


def test_masked_tensor_draw_is_refused_as_torch_refuses_it():
    def masked():
        return torch.masked.as_masked_tensor(torch.zeros(3), torch.tensor([True, False, True]))

    with pytest.raises(TypeError) as by_torch:
        masked().normal_(generator=torch.Generator().manual_seed(0))
    mt = masked()
    with pytest.raises(type(by_torch.value)):
        mt.normal_(generator=csprng.create_generator(0))
    assert mt.get_data().tolist() == [0.0, 0.0, 0.0]


class _Logged(torch.Tensor):
    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("call", [
    lambda t, g: t.normal_(generator=g),
    lambda t, g: t.uniform_(-1, 1, generator=g),
    lambda t, g: torch.randn_like(t, generator=g),
    lambda t, g: torch.bernoulli(t.abs().clamp(max=1), generator=g),
], ids=["normal_", "uniform_", "randn_like", "bernoulli"])
def test_torch_function_subclass_sees_the_call_as_with_torch_generator(call):
    seen = {}
    for kind, g in (("torch", torch.Generator().manual_seed(0)),
                    ("ember", csprng.create_generator(0))):
        t = torch.zeros(3).as_subclass(_Logged)
        _Logged.calls.clear()
        r = call(t, g)
        seen[kind] = (type(r), list(_Logged.calls))
    assert seen["ember"] == seen["torch"]


def test_dtensor_draws_reach_every_shard():
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for placement in (Shard(0), Replicate()):
            for draw in (_normal, _init_normal, _kaiming):
                d = distribute_tensor(torch.zeros(4), mesh, [placement])
                draw(d, csprng.create_generator(0))
                assert torch.equal(d.full_tensor(), _plain(draw).flatten()), (placement, draw.__name__)
            r = torch.rand_like(distribute_tensor(torch.zeros(4), mesh, [placement]),
                                generator=csprng.create_generator(0))
            assert torch.equal(r.full_tensor(), torch.rand(4, generator=csprng.create_generator(0)))
    finally:
        dist.destroy_process_group()


_TWO_RANKS = """
import os, sys, torch, torch.distributed as dist
import ember.csprng as csprng
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
mesh = init_device_mesh("cpu", (2,))
for name, make in (("os-keyed", csprng.create_random_device_generator),
                   ("seeded", lambda: csprng.create_generator(7))):
    for placement in (Replicate(), Shard(0)):
        d = distribute_tensor(torch.zeros(4, 4), mesh, [placement])
        try:
            d.normal_(generator=make())
        except RuntimeError as e:
            outcome = "refused" if "same seed" in str(e) else repr(e)
        else:
            local = d.to_local().contiguous()
            both = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(both, local)
            outcome = "equal" if torch.equal(both[0], both[1]) else "differ"
        if rank == 0:
            print(name, type(placement).__name__, outcome, flush=True)
dist.destroy_process_group()
"""


def test_a_replicated_dtensor_is_never_left_different_on_two_ranks(tmp_path):
    # every rank draws the whole tensor: equal generators keep replicas equal; an OS-keyed
    # generator (never equal on two ranks) is refused for a replicated DTensor
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(r), str(init)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0].split("\n")[:-1] == [
        "os-keyed Replicate refused", "os-keyed Shard differ",
        "seeded Replicate equal", "seeded Shard differ"], outs
