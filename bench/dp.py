"""DP-SGD cost of Opacus secure mode on ember.csprng, side by side in one process.

1. The same DP-SGD step with Opacus secure mode on ember against Opacus non-secure mode (torch's
   default generator), interleaved, on two models: the model of Opacus's MNIST example (two
   convolutions and two linear layers, 26 k parameters, 28x28 grey inputs, batch 240 = its
   sample rate 0.004 of 60 000) and the small CNN (32x32 RGB inputs, batch 256). Goal: <= 1.05x
   per step on both (median of the per-round ratios; min and max are the spread).
2. Opacus's secure-mode noise procedure (``_generate_noise(secure_mode=True)``) for a 10 M-parameter
   reference with ember's generator against the same procedure with a ``torch.Generator``.
   Goal: ember faster.

Timings are noisy on a shared machine: compare only the ratios of one run; the load average is
printed. ``--quick`` for a short run (a check that it works, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import ember.csprng as csprng

csprng.provide_torchcsprng()  # Opacus secure mode imports torchcsprng


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))


class _Flatten512(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(len(x), -1)


def _mnist_example() -> nn.Module:
    """The architecture of Opacus's MNIST example (1x28x28 -> 16x14x14 -> 32x4x4 -> 32 -> 10)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
                         nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1), _Flatten512(),
                         nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


MODELS = {"Opacus MNIST example": (_mnist_example, (1, 28, 28), 240),
          "small CNN": (_cnn, (3, 32, 32), 256)}


def _private(secure: bool, make, shape, batch: int):
    from opacus import PrivacyEngine

    model = make()
    data = torch.utils.data.TensorDataset(torch.randn(batch * 4, *shape),
                                          torch.randint(0, 10, (batch * 4,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp", secure_mode=secure)
        model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.05), data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0)
    return model, opt


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def bench_step(rounds: int, make, shape, batch: int) -> dict:
    sides = {"secure (ember)": _private(True, make, shape, batch),
             "non-secure (torch)": _private(False, make, shape, batch)}
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    times: dict[str, list[float]] = {k: [] for k in sides}
    for model, opt in sides.values():
        _step(model, opt, x, y)  # warm-up
    for _ in range(rounds):
        for name, (model, opt) in sides.items():
            _step(model, opt, x, y)  # untimed call of its own first (see docs/csprng.md, Speed)
            t = time.perf_counter()
            _step(model, opt, x, y)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["secure (ember)"], times["non-secure (torch)"],
                                    strict=True)]
    return {"batch": batch, "parameters": sum(p.numel() for p in sides["secure (ember)"][0]
                                               .parameters()),
            "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "ratios": ratios}


def bench_noise(rounds: int, n: int) -> dict:
    from opacus.optimizers.optimizer import _generate_noise

    reference = torch.zeros(n)
    gens = {"ember": csprng.create_random_device_generator(), "torch.Generator": torch.Generator()}
    times: dict[str, list[float]] = {k: [] for k in gens}
    for _ in range(rounds):
        for name, g in gens.items():
            _generate_noise(1.0, reference, generator=g, secure_mode=True)
            t = time.perf_counter()
            _generate_noise(1.0, reference, generator=g, secure_mode=True)
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    return {"best_s": best, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "speedup_best": best["torch.Generator"] / best["ember"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="few rounds, 1 M noise values")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dp.json")
    args = p.parse_args(argv)
    rounds = 5 if args.quick else 21
    n = 1_000_000 if args.quick else 10_000_000
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average before: {load}")
    steps = {name: bench_step(rounds, make, shape, batch)
             for name, (make, shape, batch) in MODELS.items()}
    noise = bench_noise(max(rounds // 3, 2), n)
    print(f"{'case':50s} {'ember':>9s} {'baseline':>9s} {'ratio':>7s} {'min..max':>13s}")
    for name, step in steps.items():
        label = f"DP-SGD step, {name}, batch {step['batch']} (median ms)"
        print(f"{label:50s} {step['median_s']['secure (ember)'] * 1e3:9.1f} "
              f"{step['median_s']['non-secure (torch)'] * 1e3:9.1f} {step['ratio_median']:7.3f} "
              f"{step['ratio_min']:6.3f}..{step['ratio_max']:.3f}")
    print(f"{f'secure noise, {n / 1e6:g} M values (best ms)':50s} "
          f"{noise['best_s']['ember'] * 1e3:9.1f} {noise['best_s']['torch.Generator'] * 1e3:9.1f} "
          f"{1 / noise['speedup_best']:7.3f}")
    after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"ratio = ember / baseline over {rounds} interleaved rounds (step goal <= 1.05; noise "
          f"goal < 1). Load average after: {after}. Shared CPU: noisy.")
    result = {"quick": args.quick, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rounds": rounds, "load_before": load, "load_after": after,
              "step": steps, "noise": {"values": n, **noise}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
