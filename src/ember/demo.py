"""``ember demo``: the whole stack on scikit-learn's bundled digits data (no download).

It writes the digits as PNG + cls tar shards (ember.shards), streams them back with a shuffle
drawn by ember.csprng, trains a small network with SGD and then an SWA/SWAG phase under bf16
autocast (ember.train), and compares the final SGD model, SWA and SWAG's Bayesian model average on
the test shards (ember.swa). It prints the table, the ember.csprng throughput table, and writes a
learning curve and reliability diagrams as PNG files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["DemoSettings", "register", "run_demo", "write_digits_shards"]

DEFAULT_OUT = Path("ember-demo-out")


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of the demo run (``quick`` is the reduced one used by tests)."""

    epochs: int = 30
    swa_start: int = 15
    batch_size: int = 32
    lr: float = 0.1
    swa_lr: float = 0.05
    hidden: int = 128
    swag_rank: int = 10
    swag_samples: int = 30
    seed: int = 0

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(epochs=6, swa_start=3, swag_rank=3, swag_samples=5)


def write_digits_shards(root: Path, *, test_size: float = 0.3, seed: int = 0,
                        maxcount: int = 200) -> tuple[str, str, int, int]:
    """Write the digits as 8x8 grayscale PNG + cls shards under ``root``; returns the train and
    test brace patterns and their sample counts."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from ember.shards import ShardWriter

    x, y = load_digits(return_X_y=True)
    images = np.rint(x.reshape(-1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)
    idx_tr, idx_te = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed,
                                      stratify=y)
    root.mkdir(parents=True, exist_ok=True)
    patterns = []
    for split, idx in (("train", idx_tr), ("test", idx_te)):
        for old in root.glob(f"{split}-*.tar"):
            old.unlink()
        with ShardWriter(str(root / f"{split}-%06d.tar"), maxcount=maxcount) as writer:
            for i in idx:
                writer.write({"__key__": f"digit{i:05d}", "png": images[i], "cls": int(y[i])})
        n = len(writer.shards)
        patterns.append(str(root / f"{split}-{{000000..{n - 1:06d}}}.tar"))
    return patterns[0], patterns[1], len(idx_tr), len(idx_te)


def _model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 10))


def _learning_curve(history: list[dict], swa_start: int, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [r["epoch"] + 1 for r in history]
    fig = Figure(figsize=(8, 3.5), dpi=100)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax1.plot(epochs, [r["train_loss"] for r in history], label="train loss")
    ax1.plot(epochs, [r["eval_nll"] for r in history], label="test NLL")
    ax1.set_yscale("log")
    ax1.set_xlabel("epoch")
    ax1.set_title("loss")
    ax2.plot(epochs, [r["eval_accuracy"] for r in history], color="C2", label="test accuracy")
    ax2.set_xlabel("epoch")
    ax2.set_title("test accuracy (SGD iterate)")
    for ax in (ax1, ax2):
        ax.axvline(swa_start + 0.5, color="grey", linestyle="--", linewidth=1, label="SWA starts")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def _metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    from ember.swa import accuracy, expected_calibration_error, nll

    return {"accuracy": accuracy(probs, labels), "nll": nll(probs, labels),
            "ece": expected_calibration_error(probs, labels)}


def format_results(rows: dict[str, dict[str, float]]) -> str:
    """The demo's comparison table."""
    head = f"{'model':<28}{'test acc':>10}{'NLL':>10}{'ECE':>10}"
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(f"{name:<28}{m['accuracy']:>10.4f}{m['nll']:>10.4f}{m['ece']:>10.4f}")
    return "\n".join(lines)


def _benchmark_table(quick: bool) -> str:
    try:
        from ember.csprng.benchmark import format_table, run
    except ImportError as exc:  # the benchmark module is part of ember.csprng; report, don't fail
        return f"(ember.csprng benchmark unavailable: {exc})"
    return format_table(run(quick=True, sizes_mib=(1,) if quick else None))


def run_demo(out: Path = DEFAULT_OUT, *, quick: bool = False, progress: bool = True,
             benchmark: bool = True, settings: DemoSettings | None = None) -> dict[str, Any]:
    """Run the demo, print its tables, and return the metrics and the paths written."""
    from ember.csprng import create_generator
    from ember.swa import bayesian_average, reliability_diagram
    from ember.train import TrainConfig, fit, image_class_loader, predict

    settings = settings or (DemoSettings.quick() if quick else DemoSettings())
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_urls, test_urls, n_train, n_test = write_digits_shards(out / "shards", seed=settings.seed)
    print(f"wrote {n_train} train and {n_test} test digits as PNG+cls shards to {out / 'shards'}")

    torch.manual_seed(settings.seed)
    shuffle_generator = create_generator(settings.seed)  # ember.csprng draws the data shuffles
    train = image_class_loader(train_urls, settings.batch_size, seed=settings.seed, shuffle=500,
                               grayscale=True, generator=shuffle_generator)
    test = image_class_loader(test_urls, 256, shuffle=0, grayscale=True, split_ranks=False)
    model = _model(settings.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=0.9, weight_decay=5e-4)
    config = TrainConfig(epochs=settings.epochs, precision="bf16", swa_start=settings.swa_start,
                         swa_lr=settings.swa_lr, swag_rank=settings.swag_rank, seed=settings.seed,
                         metrics_path=out / "metrics.jsonl", progress=progress)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    print(f"training {settings.epochs} epochs under bf16 autocast (SWA/SWAG from epoch "
          f"{settings.swa_start + 1}) ...")
    result = fit(model, optimizer, train, config, eval_loader=test)
    t_train = time.perf_counter() - t0

    # evaluation in fp32: bf16 logits would round the probabilities the metrics compare
    rows = {}
    p_sgd, labels = predict(result.model, test)
    rows["SGD (final iterate)"] = _metrics(p_sgd, labels)
    p_swa, _ = predict(result.swa.module, test)
    rows["SWA"] = _metrics(p_swa, labels)
    p_swag = bayesian_average(result.model, result.swag, [x for x, _ in test],
                              n_samples=settings.swag_samples,
                              generator=create_generator(settings.seed).fold_in(1))
    rows[f"SWAG (BMA, {settings.swag_samples} samples)"] = _metrics(p_swag, labels)

    print()
    print(format_results(rows))
    curve = _learning_curve(result.history, settings.swa_start, out / "learning_curve.png")
    rel = reliability_diagram(p_swag, labels, out / "reliability_swag.png",
                              title="SWAG Bayesian average: reliability")
    rel_sgd = reliability_diagram(p_sgd, labels, out / "reliability_sgd.png",
                                  title="final SGD model: reliability")
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{result.steps} steps in {t_train:.1f} s; metrics log {out / 'metrics.jsonl'}")
    print(f"plots: {curve}, {rel}, {rel_sgd}")
    if benchmark:
        print("\nember.csprng throughput against torch's default CPU generator:")
        print(_benchmark_table(quick))
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s; outputs in {out.resolve()}")
    return {"results": rows, "learning_curve": curve, "reliability": rel,
            "reliability_sgd": rel_sgd, "metrics_log": out / "metrics.jsonl",
            "history": result.history, "steps": result.steps}


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ember demo`` to the ``ember`` command."""
    p = sub.add_parser(
        "demo", help="train on bundled digits shards: SGD vs SWA vs SWAG, plots, csprng throughput",
        description="Write scikit-learn's bundled digits data as tar shards, stream them, train a "
        "small network with SGD then SWA/SWAG under bf16 autocast, print test accuracy, NLL and "
        "ECE of the final SGD model, SWA and SWAG, and the ember.csprng throughput table; write a "
        "learning curve and reliability diagrams (PNG).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"output directory for shards, plots and logs (default: ./{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="a few epochs only (for tests)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-benchmark", action="store_true", help="skip the csprng throughput table")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    missing = [m for m in ("sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ember demo: error: needs {' and '.join(missing)}; install them with "
              "pip install 'ember[demo]'", file=sys.stderr)
        return 2
    run_demo(args.out, quick=args.quick, progress=not args.no_progress,
             benchmark=not args.no_benchmark)
    return 0
