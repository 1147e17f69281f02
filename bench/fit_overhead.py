"""Per-optimizer-step overhead of ``ember.train.fit`` against a hand-written loop doing the same work.

Both sides train the same small MLP (32-64-10, fp32, SGD with momentum) on the same tensors in
batches of 8 for 4 epochs (256 optimizer steps), from the same initial weights, and read each
step's loss as a float (``fit`` does, for its epoch loss). Variants:

- ``plain``: ``TrainConfig(epochs=4, progress=False)`` against forward, backward, step, zero_grad;
- ``ema``: ``TrainConfig(ema_decay=0.999)`` against the same loop calling
  ``ember.swa.EMA(model, 0.999).update(model)`` after every step;
- ``log+ckpt``: ``TrainConfig(metrics_path=..., checkpoint_dir=...)`` (a JSON line per step and per
  epoch, a checkpoint at every epoch end) against a loop writing and flushing the same kind of JSON
  lines and saving model, optimizer and torch's random state with ``torch.save`` to a temporary
  file renamed into place at every epoch end.

A run's time covers the whole call (``fit``'s setup included); the overhead per step is
``(fit - hand) / steps`` of one round. The row ``setup`` is a run of one step (one batch, one
epoch, plain): its overhead is ``fit``'s fixed cost per call. Rounds interleave every case and
alternate which side goes first. Each run is timed by process CPU time (torch on one thread by
default: the figure to compare, as it moves little when other processes share the CPU) and by
wall-clock time (which also counts waiting for the CPU and the disk). The tables give medians
over rounds, the quartiles of the per-round overhead and the min..max of the per-round ratio
fit / hand. The load average is recorded before and after: compare runs taken under similar
load. ``--quick`` (3 rounds) checks that it runs; it is not a measurement.

    python bench/fit_overhead.py            # about a minute (21 rounds)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.swa import EMA
from ember.train import TrainConfig, fit

FEATURES, HIDDEN, CLASSES = 32, 64, 10
EXAMPLES, BATCH, EPOCHS = 512, 8, 4
LR, MOMENTUM, DECAY = 0.01, 0.9, 0.999
VARIANTS = ("plain", "ema", "log+ckpt")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def _loader(examples: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(examples, FEATURES, generator=g),
                                          torch.randint(0, CLASSES, (examples,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _write(log: Any, record: dict[str, Any]) -> None:
    log.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")
    log.flush()


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def hand(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         loader: torch.utils.data.DataLoader, epochs: int, folder: Path) -> int:
    """The hand-written loop; returns the optimizer steps taken."""
    ema = EMA(model, DECAY) if variant == "ema" else None
    log = open(folder / "metrics.jsonl", "a", encoding="utf-8") if variant == "log+ckpt" else None  # noqa: SIM115
    step = 0
    try:
        for epoch in range(epochs):
            model.train()
            total = 0.0
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                value = float(loss.detach())
                total += value
                if ema is not None:
                    ema.update(model)
                if log is not None:
                    _write(log, {"event": "step", "step": step, "epoch": epoch, "loss": value,
                                 "lr": optimizer.param_groups[0]["lr"]})
            if log is not None:
                _write(log, {"event": "epoch", "epoch": epoch, "train_loss": total / len(loader),
                             "steps": step})
                _save(folder / "last.pt", {"model": model.state_dict(),
                                           "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                                           "rng": torch.get_rng_state()})
    finally:
        if log is not None:
            log.close()
    return step


def with_fit(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer,
             loader: torch.utils.data.DataLoader, epochs: int, folder: Path) -> int:
    """The same training through ``ember.train.fit``; returns the optimizer steps taken."""
    options: dict[str, Any] = {}
    if variant == "ema":
        options["ema_decay"] = DECAY
    elif variant == "log+ckpt":
        options.update(metrics_path=folder / "metrics.jsonl", checkpoint_dir=folder / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # however the config is spelled later
        result = fit(model, optimizer, loader, TrainConfig(epochs=epochs, progress=False, **options))
    return result.steps


def _timed(side: Callable[..., int], variant: str, initial: nn.Module,
           loader: torch.utils.data.DataLoader, epochs: int
           ) -> tuple[dict[str, float], int, nn.Module]:
    """Seconds (CPU and wall) of one run from ``initial``, its steps and the trained model."""
    model = copy.deepcopy(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    folder = Path(tempfile.mkdtemp(prefix="ember-fit-overhead-"))
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        steps = side(variant, model, optimizer, loader, epochs, folder)
        seconds = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}
        return seconds, steps, model
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _summary(hand_s: list[float], fit_s: list[float], steps: int) -> dict[str, Any]:
    overhead = [(f - h) / steps for f, h in zip(fit_s, hand_s, strict=True)]
    ratio = [f / h for f, h in zip(fit_s, hand_s, strict=True)]
    q1, q3 = _quartiles(overhead)
    return {"hand_s": hand_s, "fit_s": fit_s,
            "hand_per_step_median_s": statistics.median(hand_s) / steps,
            "fit_per_step_median_s": statistics.median(fit_s) / steps,
            "overhead_per_step_s": overhead,
            "overhead_per_step_median_s": statistics.median(overhead),
            "overhead_per_step_q1_s": q1, "overhead_per_step_q3_s": q3,
            "ratio_median": statistics.median(ratio), "ratio_min": min(ratio),
            "ratio_max": max(ratio)}


def _warm_up(cases: dict[str, tuple[str, Any, int]], initial: nn.Module) -> None:
    """One untimed run of each side per case; both sides must train to the same weights (the
    same work) in the same number of steps."""
    for case, (variant, loader, epochs) in cases.items():
        (_, n_hand, by_hand), (_, n_fit, by_fit) = (_timed(side, variant, initial, loader, epochs)
                                                    for side in (hand, with_fit))
        same = all(torch.equal(a, b) for a, b in zip(by_hand.state_dict().values(),
                                                     by_fit.state_dict().values(), strict=True))
        if n_hand != n_fit or not same:
            raise RuntimeError(f"{case}: the hand loop and fit do not train alike ({n_hand} and "
                               f"{n_fit} steps, weights {'equal' if same else 'differ'})")


def measure(rounds: int) -> dict[str, Any]:
    """Interleaved rounds of every case; per case and clock (process CPU time, wall time) the
    per-round times, overheads per step and ratios."""
    initial = _model()
    cases = {v: (v, _loader(EXAMPLES), EPOCHS) for v in VARIANTS}
    cases["setup"] = ("plain", _loader(BATCH), 1)
    _warm_up(cases, initial)
    sides = {"hand": hand, "fit": with_fit}
    times: dict[str, dict[str, list[dict[str, float]]]] = {c: {"hand": [], "fit": []} for c in cases}
    steps: dict[str, int] = {}
    for r in range(rounds):
        for case, (variant, loader, epochs) in cases.items():
            for name in ("hand", "fit") if r % 2 == 0 else ("fit", "hand"):
                seconds, steps[case], _ = _timed(sides[name], variant, initial, loader, epochs)
                times[case][name].append(seconds)
    return {case: {"steps": steps[case],
                   **{clock: _summary([t[clock] for t in side["hand"]],
                                      [t[clock] for t in side["fit"]], steps[case])
                      for clock in ("cpu", "wall")}}
            for case, side in times.items()}


def _table(cases: dict[str, Any], clock: str) -> str:
    lines = [f"{clock} time: {'case':9s} {'steps':>5s} {'hand us/step':>12s} {'fit us/step':>11s} "
             f"{'overhead us/step (q1..q3)':>27s} {'fit/hand (min..max)':>21s}"]
    for case, row in cases.items():
        c = row[clock]
        lines.append(
            f"{' ' * (len(clock) + 7)}{case:9s} {row['steps']:5d} "
            f"{c['hand_per_step_median_s'] * 1e6:12.1f} "
            f"{c['fit_per_step_median_s'] * 1e6:11.1f} "
            f"{c['overhead_per_step_median_s'] * 1e6:9.1f} "
            f"({c['overhead_per_step_q1_s'] * 1e6:7.1f}..{c['overhead_per_step_q3_s'] * 1e6:7.1f}) "
            f"{c['ratio_median']:7.2f} ({c['ratio_min']:5.2f}..{c['ratio_max']:5.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21, help="interleaved rounds (default 21)")
    p.add_argument("--quick", action="store_true", help="3 rounds: a check that it runs")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: tiny batches gain nothing from more)")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).parent / "results" / "fit_overhead.json")
    args = p.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average before: {load_before}")
    start = time.perf_counter()
    cases = measure(rounds)
    wall = time.perf_counter() - start
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(_table(cases, "cpu"))
    print(_table(cases, "wall"))
    print(f"{rounds} interleaved rounds, {args.threads} thread(s), {wall:.0f} s; load average "
          f"after: {load_after}. Medians over rounds; shared CPU: compare runs under similar load.")
    result = {"quick": args.quick, "torch": torch.__version__, "threads": args.threads,
              "rounds": rounds, "cpus": os.cpu_count(), "load_before": load_before,
              "load_after": load_after, "wall_s": wall,
              "setting": {"model": f"MLP {FEATURES}-{HIDDEN}-{CLASSES}", "batch": BATCH,
                          "examples": EXAMPLES, "epochs": EPOCHS, "optimizer": "SGD",
                          "lr": LR, "momentum": MOMENTUM, "ema_decay": DECAY,
                          "precision": "fp32"},
              "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
