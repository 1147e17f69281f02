"""Tune the peak learning rate of ``ember demo``'s cosine-annealed SGD baseline.

The protocol is in docs/experiments/train.md ("The tuning run behind the baseline's rate"),
written before this script was first run: peak rates {0.25, 0.5, 1, 2} x the demo's 0.05, each
cosine-annealed to 0 over the demo's 30 epochs, seeds 0, 1, 2, trained on the early-stopping
baseline's training part (the noisy training labels minus a stratified 15% held out, seed 0) and
scored by accuracy on the held-out 15% (noisy labels, as a user would have them). The highest mean
accuracy wins, ties to the smaller rate. The test sets are never used. The result goes into
``ember.demo.PROTOCOL["baseline_lr"]`` by hand, with this script's output recorded in
docs/experiments/train.md.

    python bench/demo_tuning.py [--json bench/results/demo_tuning.json] [--epochs 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ember.demo.protocol import PROTOCOL, _model, _optimizer, _read_all, write_digits_shards
from ember.swa import accuracy

if str(Path(__file__).parent) not in sys.path:  # the SWA benches' cosine-SGD loop
    sys.path.append(str(Path(__file__).parent))
from swa_family_tuning import train_cosine as cosine_run  # noqa: E402

FACTORS = (0.25, 0.5, 1.0, 2.0)
SEEDS = (0, 1, 2)


def held_out_split(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The early-stopping baseline's split: (x_fit, y_fit, x_val, y_val)."""
    from sklearn.model_selection import train_test_split

    fit_idx, val_idx = train_test_split(torch.arange(len(y)).numpy(),
                                        test_size=PROTOCOL["val_fraction"], random_state=0,
                                        stratify=y.numpy())
    fit_idx, val_idx = torch.as_tensor(fit_idx), torch.as_tensor(val_idx)
    return x[fit_idx], y[fit_idx], x[val_idx], y[val_idx]


def train_cosine(lr: float, seed: int, epochs: int, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The demo's model and optimizer at peak rate ``lr``, cosine-annealed to 0 over ``epochs``."""
    torch.manual_seed(seed)  # the demo's initial weights for this seed
    model = _model()
    return cosine_run(model, _optimizer(model, lr), seed, epochs, x, y)


@torch.no_grad()
def held_out_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return accuracy(torch.softmax(model(x), -1), y)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--json", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "demo_tuning.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_digits_shards(Path(tmp), noise_rate=PROTOCOL["label_noise_rate"])
        x, y = _read_all(shards["train"])
    x_fit, y_fit, x_val, y_val = held_out_split(x, y)
    rows = []
    t0 = time.perf_counter()
    for f in FACTORS:
        lr = PROTOCOL["lr"] * f
        accs = [held_out_accuracy(train_cosine(lr, s, args.epochs, x_fit, y_fit), x_val, y_val)
                for s in SEEDS]
        rows.append({"lr": lr, "val_accuracy": accs, "mean": statistics.mean(accs),
                     "std": statistics.stdev(accs)})
        print(f"lr {lr:<7g} held-out accuracy (noisy labels) {statistics.mean(accs):.4f} "
              f"± {statistics.stdev(accs):.4f}  [{min(accs):.4f}-{max(accs):.4f}]", flush=True)
    # highest mean; ties (equal at 4 digits) to the smaller rate: rows are in increasing rate
    best = max(rows, key=lambda r: (round(r["mean"], 4), -r["lr"]))
    print(f"chosen peak lr: {best['lr']:g} ({time.perf_counter() - t0:.1f} s, "
          f"{args.epochs} epochs, seeds {list(SEEDS)}, {len(y_fit)} fit / {len(y_val)} held out)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"epochs": args.epochs, "seeds": list(SEEDS), "rows": rows,
                                     "chosen_lr": best["lr"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
