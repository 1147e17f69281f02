"""DP-SGD cost of Opacus secure mode on ember.csprng, side by side in one process.

1. The same DP-SGD step with Opacus secure mode on ember against Opacus non-secure mode (torch's
   default generator), interleaved, on two models: the model of Opacus's MNIST example (two
   convolutions and two linear layers, 26 k parameters, 28x28 grey inputs, batch 240 = its
   sample rate 0.004 of 60 000) and the small CNN (32x32 RGB inputs, batch 256). Goal: <= 1.05x
   per step on both (median of the per-round ratios; min and max are the spread).
2. Opacus's secure-mode noise procedure (``_generate_noise(secure_mode=True)``) for a 10 M-parameter
   reference with ember's generator against the same procedure with a ``torch.Generator``.
   Goal: ember faster.

Both cases also time secure mode with the noise of all parameters drawn together
(``ember.train.privacy.fuse_secure_noise``: the same values, one ``normal_foreach_`` pass), the
way ``ember.train.fit`` draws it.

``--device cuda`` runs case 1 on the GPU with a 4-conv GroupNorm CNN (about 1.1 M parameters, 14
tensors) at batch 256 instead (goal: secure <= 1.05x non-secure per step), timing with CUDA
synchronisation; case 2 is skipped there.

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


def _cnn_gn() -> nn.Module:
    """4 convolutions with GroupNorm, about 1.1 M parameters (the issue's CUDA reference)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin, cout in ((3, 64), (64, 128), (128, 256), (256, 320)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(),
                   nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(320, 10))


MODELS = {"Opacus MNIST example": (_mnist_example, (1, 28, 28), 240),
          "small CNN": (_cnn, (3, 32, 32), 256)}
CUDA_MODELS = {"GroupNorm CNN 1.1M": (_cnn_gn, (3, 32, 32), 256)}


def _private(secure: bool, make, shape, batch: int, device: str = "cpu", fused: bool = False):
    from opacus import PrivacyEngine

    model = make().to(device)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 4, *shape),
                                          torch.randint(0, 10, (batch * 4,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp", secure_mode=secure)
        model, opt, _ = engine.make_private(module=model, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.05), data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=1.0)
    if fused:
        from ember.train.privacy import fuse_secure_noise

        fuse_secure_noise(opt)
    return model, opt


def _step(model, opt, x, y) -> None:
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def bench_step(rounds: int, make, shape, batch: int, device: str = "cpu") -> dict:
    sides = {"secure (ember)": _private(True, make, shape, batch, device),
             "secure (ember, fused noise)": _private(True, make, shape, batch, device, fused=True),
             "non-secure (torch)": _private(False, make, shape, batch, device)}
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    times: dict[str, list[float]] = {k: [] for k in sides}
    for model, opt in sides.values():
        _step(model, opt, x, y)  # warm-up
    for _ in range(rounds):
        for name, (model, opt) in sides.items():
            _step(model, opt, x, y)  # untimed call of its own first (see docs/csprng.md, Speed)
            _sync(device)
            t = time.perf_counter()
            _step(model, opt, x, y)
            _sync(device)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"device": device, "batch": batch,
           "parameters": sum(p.numel() for p in sides["secure (ember)"][0].parameters()),
           "median_s": med, "min_s": {k: min(v) for k, v in times.items()}}
    for key, side in (("ratio", "secure (ember)"), ("ratio_fused", "secure (ember, fused noise)")):
        ratios = [a / b for a, b in zip(times[side], times["non-secure (torch)"], strict=True)]
        out.update({f"{key}_median": statistics.median(ratios), f"{key}_min": min(ratios),
                    f"{key}_max": max(ratios), f"{key}s": ratios})
    return out


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
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the DP-SGD step of a 1.1 M-parameter GroupNorm CNN on the GPU")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/dp.py --device cuda: no CUDA device; nothing measured.")
        return {}
    rounds = 5 if args.quick else 21
    n = 1_000_000 if args.quick else 10_000_000
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average before: {load}")
    models = CUDA_MODELS if args.device == "cuda" else MODELS
    steps = {name: bench_step(rounds, make, shape, batch, args.device)
             for name, (make, shape, batch) in models.items()}
    noise = bench_noise(max(rounds // 3, 2), n) if args.device == "cpu" else None
    if args.device == "cuda":
        from ember.csprng.cuda_backend import fast_path

        print(f"device {torch.cuda.get_device_name()}, ember CUDA path {fast_path()}")
    print(f"{'case':50s} {'ember':>9s} {'baseline':>9s} {'ratio':>7s} {'min..max':>13s}")
    for name, step in steps.items():
        for key, side, label in (
                ("ratio", "secure (ember)",
                 f"DP-SGD step, {name}, batch {step['batch']} (median ms)"),
                ("ratio_fused", "secure (ember, fused noise)", "  the same, noise fused")):
            print(f"{label:50s} {step['median_s'][side] * 1e3:9.2f} "
                  f"{step['median_s']['non-secure (torch)'] * 1e3:9.2f} "
                  f"{step[key + '_median']:7.3f} "
                  f"{step[key + '_min']:6.3f}..{step[key + '_max']:.3f}")
    if noise is not None:
        print(f"{f'secure noise, {n / 1e6:g} M values (best ms)':50s} "
              f"{noise['best_s']['ember'] * 1e3:9.1f} "
              f"{noise['best_s']['torch.Generator'] * 1e3:9.1f} {1 / noise['speedup_best']:7.3f}")
    after = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"goal: secure / non-secure <= 1.05. ratio = ember / baseline over {rounds} interleaved "
          f"rounds (noise goal < 1). Load average after: {after}. Shared CPU: noisy.")
    result = {"quick": args.quick, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rounds": rounds, "load_before": load, "load_after": after,
              "device": args.device, "step": steps,
              "noise": None if noise is None else {"values": n, **noise}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
