"""The differences from reference code that docs/swa.md states ("Where ember differs from the
reference code") hold, so the page cannot drift from the code: EMA without ``step=`` and with
``warmup=False``, SWAG's low-rank scaling and fast-SWA's collection points.

The references are written from the reference implementations' formulas: timm's
``ModelEmaV3.get_decay`` (``step=None`` returns the constant decay; otherwise ``k = max(0, step -
update_after_step - 1)``, 0 for ``k <= 0``, the constant decay without warm-up) and swa_gaussian's
SWAG sample, whose low-rank term divides by ``sqrt(max_num_models - 1)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.swa import EMA, SWAG, FastSWASchedule


def timm_get_decay_no_warmup(step: int | None, decay: float, update_after_step: int) -> float:
    if step is None:
        return decay
    k = max(0, step - update_after_step - 1)
    return 0.0 if k <= 0 else decay


def test_warmup_false_copies_one_step_fewer_than_timm_with_update_after_step():
    ema = EMA(nn.Linear(2, 2), 0.99, warmup=False, update_after_step=3)
    ours = [ema.current_decay(step) for step in range(1, 7)]
    timm = [timm_get_decay_no_warmup(step, 0.99, 3) for step in range(1, 7)]
    assert ours == [0.0, 0.0, 0.0, 0.99, 0.99, 0.99]
    assert timm == [0.0, 0.0, 0.0, 0.0, 0.99, 0.99]


def test_update_without_step_warms_up_where_timm_uses_the_constant_decay():
    model = nn.Linear(2, 2)
    ema = EMA(model, 0.9999)
    ema.update(model)
    with torch.no_grad():
        model.weight.add_(1.0)
    # the second update is at n_updates + 1 = 2: the warm-up's value, far below 0.9999
    assert ema.current_decay() < 0.2
    assert timm_get_decay_no_warmup(None, 0.9999, 0) == 0.9999


def reference_points(every: int, steps: int) -> set[int]:
    """fastswa-semi-sup's stride: after every ``every``-th step counted from the start of the
    cyclic phase (0-based step s collects when (s + 1) % every == 0), across cycle boundaries."""
    return {s for s in range(steps) if (s + 1) % every == 0}


def test_fastswa_points_restart_every_cycle_where_the_reference_stride_runs_on():
    ours = {s for s in range(20) if FastSWASchedule(10, 3).collect_at(s)}
    assert ours == {0, 3, 6, 9, 10, 13, 16, 19}  # the same points in each cycle, its end included
    assert reference_points(3, 20) == {2, 5, 8, 11, 14, 17}
    # when every divides the cycle the two coincide
    assert {s for s in range(20) if FastSWASchedule(10, 5).collect_at(s)} == reference_points(5, 20)


def test_swag_low_rank_term_divides_by_the_collected_count_below_max_rank():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    swag = SWAG(model, max_rank=5)
    for _ in range(3):  # fewer than max_rank
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        swag.collect(model)
    theta = swag.sample(scale=1.0, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    z1 = torch.randn(swag.num_parameters, generator=g)
    z2 = torch.randn(3, generator=g)
    diag = swag.mean + swag.var.clamp(min=swag.var_clamp).sqrt() * z1
    low_rank = swag.deviations[:3].t() @ z2
    assert torch.allclose(theta, diag + low_rank / 2 ** 0.5, atol=1e-6)  # sqrt(3 - 1)
    reference = diag + low_rank / 4 ** 0.5  # swa_gaussian: sqrt(max_rank - 1)
    assert not torch.allclose(theta, reference, atol=1e-3)
