"""fast-SWA: collection points within cycles, the standalone FastSWA helper, persistence."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ember.swa import cyclic_lr, is_cycle_end
from ember.swa.fastswa import FastSWA, FastSWASchedule


def test_collection_points_are_every_k_steps_back_from_each_cycle_end_in_the_late_half():
    s = FastSWASchedule(10, 2, start=0.5)
    assert s.positions == [5, 7, 9] and s.per_cycle == 3
    assert [t for t in range(30) if s.collect_at(t)] == [5, 7, 9, 15, 17, 19, 25, 27, 29]
    assert FastSWASchedule(10, 3, start=0.0).positions == [0, 3, 6, 9]
    assert FastSWASchedule(8, 1, start=0.75).positions == [6, 7]


def test_every_equal_to_cycle_is_classic_cyclic_swa():
    s = FastSWASchedule(7, 7, start=0.5)
    assert FastSWASchedule(7, 7).positions == [6]
    assert [t for t in range(40) if s.collect_at(t)] == [t for t in range(40) if is_cycle_end(t, 7)]


@pytest.mark.parametrize("args, kw, match", [
    ((0, 1), {}, "cycle"), ((4, 0), {}, "every"), ((4, 5), {}, "longer than the cycle"),
    ((4, 2), {"start": 1.5}, "start"), ((4, True), {}, "every"),
])
def test_bad_schedules_are_refused(args, kw, match):
    with pytest.raises(ValueError, match=match):
        FastSWASchedule(*args, **kw)
    with pytest.raises(ValueError, match="step"):
        FastSWASchedule(4, 2).collect_at(-1)


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    return model, opt


def _train(model, opt, fast, steps, g, seen=None, lrs=None):
    for _ in range(steps):
        x = torch.randn(16, 5, generator=g)
        y = (x[:, 0] > 0).long()
        if lrs is not None:
            lrs.append(opt.param_groups[0]["lr"])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fast.step(model) and seen is not None:
            seen.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))


def test_fastswa_averages_the_collected_weights_and_drives_the_cyclic_rate():
    model, opt = _setup()
    fast = FastSWA(model, opt, lr_max=0.1, lr_min=0.01, cycle=6, every=2, start=0.5,
                   shape="linear")
    g = torch.Generator().manual_seed(1)
    seen, lrs = [], []
    _train(model, opt, fast, 18, g, seen, lrs)
    assert lrs == pytest.approx([cyclic_lr(t, lr_max=0.1, lr_min=0.01, cycle=6)
                                 for t in range(18)])
    assert len(seen) == 3 * 2 == fast.swa.n_updates  # positions 3 and 5 of each cycle
    averaged = torch.cat([p.reshape(-1) for p in fast.module.parameters()])
    torch.testing.assert_close(averaged, torch.stack(seen).mean(0))


def test_state_dict_resume_is_bit_identical():
    model, opt = _setup()
    fast = FastSWA(model, opt, lr_max=0.1, lr_min=0.01, cycle=5, every=1)
    g = torch.Generator().manual_seed(2)
    _train(model, opt, fast, 7, g)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(fast.state_dict()), g.get_state(), torch.get_rng_state())
    _train(model, opt, fast, 8, g)

    model2, opt2 = _setup()
    model2.load_state_dict(saved[0])
    fast2 = FastSWA(model2, opt2, lr_max=0.1, lr_min=0.01, cycle=5, every=1)
    opt2.load_state_dict(saved[1])
    fast2.load_state_dict(saved[2])
    g2 = torch.Generator()
    g2.set_state(saved[3])
    torch.set_rng_state(saved[4])  # dropout's draws
    _train(model2, opt2, fast2, 8, g2)
    assert fast2.steps == fast.steps == 15 and fast2.swa.n_updates == fast.swa.n_updates
    for a, b in zip(fast.module.state_dict().values(), fast2.module.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    other = FastSWA(model2, opt2, lr_max=0.1, lr_min=0.01, cycle=5, every=2)
    with pytest.raises(ValueError, match="every"):
        other.load_state_dict(fast.state_dict())


def test_quick_experiment_rows_have_the_contract_keys_and_finite_numbers():
    import importlib.util
    import math
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "swa_family_fastswa.py"
    spec = importlib.util.spec_from_file_location("swa_family_fastswa", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert "fast-SWA" in bench.PROTOCOL
    rows = bench.experiment(quick=True, seeds=[0])
    assert {(r["method"], r["test_set"]) for r in rows} == {
        (m, t) for m in ("SGD (cosine)", "SGD", "SWA", "cyclic SWA (1/cycle)", "fast-SWA")
        for t in ("clean", "pixel noise", "rotation")}
    for r in rows:
        assert r["experiment"] == "fastswa" and r["n_seeds"] == 1
        for metric in ("accuracy", "nll", "ece", "wall_s"):
            assert math.isfinite(r[f"{metric}_mean"]), (r, metric)
        assert 0.0 <= r["accuracy_mean"] <= 1.0 and r["nll_mean"] > 0
    # every method learns: 10 classes, chance is 0.1
    assert all(r["accuracy_mean"] > 0.5 for r in rows if r["test_set"] == "clean")


def test_default_collection_spans_the_whole_cycle_as_the_reference():
    # the reference (fastswa-semi-sup) collects every k steps across the whole cycle
    assert FastSWASchedule(10, 2).positions == [1, 3, 5, 7, 9]
    assert FastSWASchedule(10, 2, start=0.5).positions == [5, 7, 9]  # the window is an option


def test_cosine_cycles():
    import math

    for s in range(12):
        t = (s % 4 + 1) / 4
        want = 0.01 + (0.05 - 0.01) * (1 + math.cos(math.pi * t)) / 2
        assert cyclic_lr(s, lr_max=0.05, lr_min=0.01, cycle=4, shape="cosine") == pytest.approx(want)
    with pytest.raises(ValueError, match="shape"):
        cyclic_lr(0, lr_max=0.05, lr_min=0.01, cycle=4, shape="step")


def test_fastswa_helper_defaults_to_cosine_cycles_and_whole_cycle_collection():
    model, opt = _setup()
    fast = FastSWA(model, opt, lr_max=0.1, lr_min=0.01, cycle=6, every=2)
    lrs: list[float] = []
    _train(model, opt, fast, 12, torch.Generator().manual_seed(3), lrs=lrs)
    assert lrs == pytest.approx([cyclic_lr(t, lr_max=0.1, lr_min=0.01, cycle=6, shape="cosine")
                                 for t in range(12)])
    assert fast.swa.n_updates == 2 * 3  # positions 1, 3, 5 of each cycle
