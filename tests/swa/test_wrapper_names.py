"""Wrapper prefixes are removed only where there is a wrapper.

A model may have a child named ``module`` of its own; only the ``module.`` of a real
``DataParallel``/``DistributedDataParallel`` (and the ``_orig_mod.`` of a module that holds a
compiled module's ``_orig_mod``) is a wrapper's. Reference: torch's ``AveragedModel``, which
matches tensors by position and so has no naming problem.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import swa_utils

from ember.swa import EMA, SWA, SWAG, MultiSWA


class ChildNamedModule(nn.Module):
    """A plain model with a child called ``module`` and a top-level ``weight``: stripping the
    child's name as if it were DataParallel's gives two tensors called ``weight``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(2, 2)
        self.weight = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("scale", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) @ self.weight * self.scale


class OnlyChildNamedModule(nn.Module):
    """A plain model whose only child is called ``module``: its unwrapped averager keys
    (``module.module.*``) look like DataParallel's wrapped ones."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _step(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("cls", [SWA, EMA])
def test_plain_model_with_a_child_named_module_averages_like_torch(cls):
    model = ChildNamedModule()
    ours = cls(model) if cls is SWA else cls(model, 0.8, warmup=False)
    ref = swa_utils.AveragedModel(
        model, multi_avg_fn=None if cls is SWA else swa_utils.get_ema_multi_avg_fn(0.8))
    if cls is EMA:
        ref.update_parameters(model)  # torch's first update copies; ember copied at construction
    for t in range(4):
        _step(model, t)
        ours.update_parameters(model)
        ref.update_parameters(model)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        if k == "n_averaged":
            continue
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    again = cls(ChildNamedModule(5))
    again.load_state_dict(ref.state_dict(), strict=True)
    assert torch.equal(again.module.weight, ref.module.weight)
    assert torch.equal(again.module.module.weight, ref.module.module.weight)


@pytest.mark.parametrize("make_model", [ChildNamedModule, OnlyChildNamedModule])
def test_data_parallel_model_with_a_child_named_module(make_model):
    model = make_model()
    wrapped = nn.DataParallel(model)
    ours, ref = SWA(wrapped), swa_utils.AveragedModel(wrapped)
    for t in range(3):
        _step(model, t)
        ours.update_parameters(wrapped)
        ref.update_parameters(wrapped)
    # torch's layout: the wrapper's module. plus the model's own module.
    assert list(ours.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)
    # the unwrapped layout (a plain model's averager) loads into the wrapped model's averager
    plain = SWA(make_model(7))
    other = SWA(nn.DataParallel(make_model(8)))
    other.load_state_dict(plain.state_dict(), strict=True)
    for a, b in zip(other.module.state_dict().values(), plain.module.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    # and torch's wrapped layout too
    other.load_state_dict(ref.state_dict(), strict=True)
    assert list(other.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    # a plain model feeds the wrapped model's averager and the other way round
    ours.update_parameters(make_model(9))
    plain.update_parameters(nn.DataParallel(make_model(9)))


def test_swag_and_multiswa_keep_a_child_named_module():
    model = ChildNamedModule()
    swag = SWAG(model, max_rank=2)
    assert swag.names == [n for n, _ in model.named_parameters()]
    swag.collect(nn.DataParallel(model))
    swag.collect(model)
    assert swag.n_collected == 2
    MultiSWA([ChildNamedModule(1), nn.DataParallel(ChildNamedModule(2))])


def test_compiled_submodule_names_lose_only_the_compile_part():
    class Net(nn.Module):
        def __init__(self, compiled: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.module = nn.Linear(2, 2)
            block = nn.Linear(2, 2)
            self.block = torch.compile(block) if compiled else block

    from ember.swa._batches import unwrapped_names

    compiled = Net(compiled=True)
    names = unwrapped_names(compiled)
    assert [names(n) for n, _ in compiled.named_parameters()] == \
        ["module.weight", "module.bias", "block.weight", "block.bias"]
    swa = SWA(compiled)
    plain = Net(compiled=False)
    _step(plain, 1)
    swa.update_parameters(plain)  # matched by name across the compiled/plain child
    swa.update_parameters(compiled)
    ref = swa_utils.AveragedModel(plain)
    ref.update_parameters(plain)
    ref.update_parameters(compiled)
    for a, b in zip(swa.module.parameters(), ref.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        for make_model in (ChildNamedModule, OnlyChildNamedModule):
            model = make_model()
            ddp = DDP(model)
            ours, ref = SWA(ddp), swa_utils.AveragedModel(ddp)
            _step(model, 3)
            ours.update_parameters(ddp)
            ref.update_parameters(ddp)
            assert list(ours.state_dict()) == list(ref.state_dict())
            for k, v in ref.state_dict().items():
                assert torch.equal(ours.state_dict()[k], v), k
            plain = SWA(make_model(4))
            ours.load_state_dict(plain.state_dict(), strict=True)  # the unwrapped layout loads
            for a, b in zip(ours.module.parameters(), plain.module.parameters(), strict=True):
                assert torch.equal(a, b)
        torch.save("ok", out)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available()
                    or sys.platform == "win32", reason="needs torch.distributed with gloo")
def test_ddp_model_with_a_child_named_module(tmp_path):
    import torch.multiprocessing as mp

    out = os.path.join(tmp_path, "ok.pt")
    init_file = str(tmp_path / "init").replace("\\", "/")
    mp.spawn(_ddp_worker, args=(init_file, out), nprocs=1, join=True)
    assert torch.load(out) == "ok"


class OwnOrigMod(nn.Module):
    """A plain model (nothing compiled) whose first child the user called ``_orig_mod``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self._orig_mod = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.weight = nn.Parameter(torch.randn(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self._orig_mod(x)) @ self.weight


@pytest.mark.parametrize("cls", [SWA, EMA])
def test_a_child_called_orig_mod_is_not_a_compile_wrapper(cls):
    model = OwnOrigMod()
    kw = {} if cls is SWA else {"multi_avg_fn": swa_utils.get_ema_multi_avg_fn(0.9)}
    ours, ref = cls(model, **kw), swa_utils.AveragedModel(model, **kw)
    for i in range(4):
        _step(model, i)
        ours.update_parameters(model)
        ref.update_parameters(model)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    x = torch.randn(5, 3)
    assert torch.equal(ours(x), ref(x))


def test_swag_names_of_a_model_with_its_own_orig_mod_child():
    model = OwnOrigMod()
    swag = SWAG(model, max_rank=2)
    assert swag.names == [n for n, _ in model.named_parameters()]
    swag.collect(model)
    swag.collect(torch.compile(model, backend="eager"))  # a real wrapper around it: same names
    assert swag.n_collected == 2
    target = OwnOrigMod(1)
    swag.sample(scale=0.0, model=target)  # the mean of two equal snapshots: the model
    for (n, p), (_, q) in zip(target.named_parameters(), model.named_parameters(), strict=True):
        torch.testing.assert_close(p, q.detach(), msg=n)
