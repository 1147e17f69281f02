"""fit under DDP with a BatchNorm + dropout model: 2 gloo ranks must end with the same state.

DDP broadcasts rank 0's buffers before each forward, then every rank updates its BatchNorm
statistics from its own batch, so without care the ranks finish with different running statistics
(and ``ranks_in_sync`` false) although their parameters agree.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _batches(rank: int, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    out = []
    for _ in range(n):
        x = torch.randn(16, 6, generator=g) + rank  # different statistics on each rank
        out.append((x, (x[:, 0] > rank).long()))
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from ember.train import TrainConfig, fit, weights_digest

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.2),
                              nn.Linear(12, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        result = fit(model, opt, _batches(rank),
                     TrainConfig(epochs=3, seed=1, swa_start=1, swa_lr=0.02, ema_decay=0.9,
                                 progress=False),
                     bn_loader=_batches(rank, 2))
        torch.save({"digests": result.rank_digests,
                    "model": model.state_dict(), "swa": result.swa.module.state_dict(),
                    "ema": result.ema.module.state_dict(),
                    "swa_digest": weights_digest(result.swa.module)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fit_ends_with_the_same_batchnorm_state_on_every_rank(tmp_path):
    init_file = str(tmp_path / "init").replace("\\", "/")
    mp.spawn(_worker, args=(2, init_file, str(tmp_path)), nprocs=2, join=True)
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert len(a["digests"]) == 2 and a["digests"][0] == a["digests"][1]
    for key in ("model", "swa", "ema"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    # the statistics are real ones, not the construction-time zeros
    assert not torch.equal(a["model"]["1.running_mean"], torch.zeros(12))
    assert not torch.equal(a["swa"]["1.running_mean"], torch.zeros(12))
    assert a["swa_digest"] == b["swa_digest"]
