"""A job for ``torchrun --nproc_per_node=2``: train with ember.train.fit, optionally killed at a
step; rank 0 writes the final digests as JSON. Used by test_ddp.py."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from ember.train import TrainConfig, fit, image_class_loader, weights_digest


class Killed(RuntimeError):
    pass


def main(urls: str, out: str, kill_at: int, resume: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = image_class_loader(urls, 16, seed=1, shuffle=64, grayscale=True)
    config = TrainConfig(epochs=3, accumulate=2, max_grad_norm=1.0,
                         swa_start=1, swa_lr=0.02, swag_rank=2, seed=4, checkpoint_dir=out + "/ckpt",
                         checkpoint_every=4, resume=resume or None, progress=False)

    def on_step(step: int, record: dict) -> None:
        if step == kill_at:
            raise Killed(step)

    try:
        result = fit(model, opt, loader, config, on_step=on_step)
    except Killed:
        return 3
    if result.rank == 0:
        with open(out + "/result.json", "w") as f:
            json.dump({"digests": result.rank_digests, "swa": weights_digest(result.swa.module),
                       "steps": result.steps, "history": result.history}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
