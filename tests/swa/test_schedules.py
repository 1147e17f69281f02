"""Cyclical SWA learning rate (Izmailov et al. 2018, eq. 2) and cycle ends."""

from __future__ import annotations

import pytest
import torch

from ember.swa.schedules import CyclicSWALR, cyclic_lr, is_cycle_end


def test_cyclic_lr_follows_the_paper_formula():
    # eq. 2: alpha(i) = (1 - t(i)) a1 + t(i) a2, t(i) = (mod(i - 1, c) + 1) / c, i from 1
    a1, a2, c = 0.05, 0.01, 4
    for i in range(1, 13):
        t = (((i - 1) % c) + 1) / c
        want = (1 - t) * a1 + t * a2
        assert cyclic_lr(i - 1, lr_max=a1, lr_min=a2, cycle=c) == pytest.approx(want)
    assert [is_cycle_end(s, 4) for s in range(8)] == [False, False, False, True] * 2
    assert cyclic_lr(5, lr_max=0.1, lr_min=0.02, cycle=1) == 0.02  # cycle 1: constant


def test_cyclic_scheduler_sets_the_rate_each_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = CyclicSWALR(opt, lr_max=0.05, lr_min=0.01, cycle=4)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [cyclic_lr(s, lr_max=0.05, lr_min=0.01, cycle=4) for s in range(8)]
    assert seen == pytest.approx(want)
    state = sched.state_dict()
    sched2 = CyclicSWALR(torch.optim.SGD([p], lr=1.0), lr_max=0.05, lr_min=0.01, cycle=4)
    sched2.load_state_dict(state)
    assert sched2.last_epoch == sched.last_epoch


@pytest.mark.parametrize("kw", [dict(cycle=0), dict(cycle=2.0), dict(lr_max=0.01, lr_min=0.05)])
def test_bad_arguments_are_refused(kw):
    args = dict(lr_max=0.05, lr_min=0.01, cycle=4) | kw
    with pytest.raises(ValueError):
        cyclic_lr(0, **args)
