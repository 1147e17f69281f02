"""One rank of the SWAP test (run by tests/swa/test_swap.py under torchrun, gloo on CPU).

Trains a BatchNorm + dropout MLP on scikit-learn's digits with ember.train.recipes.swap_fit and writes, per
rank, the phase-2 weights (captured just before the average) and the final weights to JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main(out: Path) -> None:
    from sklearn.datasets import load_digits

    import ember.train.recipes.swap as swap
    from ember.train import TrainConfig

    dist.init_process_group("gloo", init_method="env://")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.long)
    x, y = x[:800], y[:800]
    shard = torch.arange(rank, len(x), size)  # phase 1: this rank's share
    large = [(x[shard][i:i + 100], y[shard][i:i + 100]) for i in range(0, len(shard), 100)]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + rank))
    small = [(x[order][i:i + 16], y[order][i:i + 16]) for i in range(0, len(x), 16)]

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    captured = {}
    original = swap.swap_average_

    def capture_then_average(m, *, group=None):
        captured["phase2"] = [p.detach().clone().reshape(-1).tolist() for p in m.parameters()]
        return original(m, group=group)

    refine = swap.refine_locally

    def capture_then_refine(m, *args, **kwargs):
        captured["phase1"] = [p.detach().clone().reshape(-1).tolist() for p in m.parameters()]
        return refine(m, *args, **kwargs)

    swap.swap_average_ = capture_then_average
    swap.refine_locally = capture_then_refine
    config = TrainConfig(epochs=2, swag_rank=None, progress=False, seed=0)
    result = swap.swap_fit(model, optimizer, large, small, config, phase2_epochs=1,
                           phase2_lr=0.05, bn_batches=10)
    # BatchNorm statistics as update_bn computes them on both ranks' first 10 phase-2 batches
    import copy

    from ember.swa import update_bn

    both = []
    for r in range(size):
        o = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 + r))
        both += [(x[o][i:i + 16], y[o][i:i + 16]) for i in range(0, 160, 16)]
    reference = copy.deepcopy(model)
    update_bn(both, reference)
    bn_ref = reference[1]
    bn = model[1]
    record = {"rank": rank, "world_size": result.world_size, "bn_batches": result.bn_batches,
              "phase1": captured["phase1"], "phase1_steps": result.phase1.steps,
              "phase2": captured["phase2"],
              "final": [p.detach().reshape(-1).tolist() for p in model.parameters()],
              "bn_mean": bn.running_mean.tolist(), "bn_var": bn.running_var.tolist(),
              "bn_mean_all_batches": bn_ref.running_mean.tolist(),
              "bn_var_all_batches": bn_ref.running_var.tolist(),
              "phase2_losses": result.phase2_losses}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
