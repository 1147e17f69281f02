"""DP-SGD cost of Opacus secure mode on ember.csprng, side by side in one process.

1. The same DP-SGD step (small CNN, 32x32 RGB inputs, batch 256) with Opacus secure mode on ember
   against Opacus non-secure mode (torch's default generator). Goal: <= 3% more per step.
2. Opacus's secure-mode noise procedure (``_generate_noise(secure_mode=True)``) for a 10 M-parameter
   reference with ember's generator against the same procedure with a ``torch.Generator``.
   Goal: ember faster.

Timings are noisy on a shared machine: compare only the ratios of one run. ``--quick`` for a short run.

``--device cuda`` runs case 1 on the GPU with a 4-conv GroupNorm CNN (about 1.1 M parameters, 14
tensors) at batch 256 instead (goal: secure <= 1.05x non-secure per step), timing with CUDA
synchronisation; case 2 is skipped there. Both devices also time secure mode with the noise of all
parameters drawn by one ``normal_foreach_`` (``ember.train.privacy.fuse_secure_noise``).
"""

from __future__ import annotations

import argparse
import json
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


def _cnn_gn() -> nn.Module:
    """4 convolutions with GroupNorm, about 1.1 M parameters (the issue's CUDA reference)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for cin, cout in ((3, 64), (64, 128), (128, 256), (256, 320)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.ReLU(),
                   nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(320, 10))


def _private(secure: bool, batch: int, device: str = "cpu", fused: bool = False):
    from opacus import PrivacyEngine

    model = _cnn() if device == "cpu" else _cnn_gn().to(device)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 4, 3, 32, 32),
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


def bench_step(rounds: int, batch: int, device: str = "cpu") -> dict:
    sides = {"secure (ember)": _private(True, batch, device),
             "secure (ember, fused noise)": _private(True, batch, device, fused=True),
             "non-secure (torch)": _private(False, batch, device)}
    x = torch.randn(batch, 3, 32, 32, device=device)
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
    return {"device": device, "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
            "ratio_median": med["secure (ember)"] / med["non-secure (torch)"],
            "ratio_fused_median": med["secure (ember, fused noise)"] / med["non-secure (torch)"]}


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
    rounds = 3 if args.quick else 15
    n = 1_000_000 if args.quick else 10_000_000
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench/dp.py --device cuda: no CUDA device; nothing measured.")
            return {}
        return _main_cuda(args, rounds)
    step = bench_step(rounds, 256)
    noise = bench_noise(max(rounds // 3, 2), n)
    print(f"{'case':46s} {'ember':>10s} {'baseline':>10s} {'ratio':>7s}")
    print(f"{'DP-SGD step, CNN 32x32, batch 256 (median ms)':46s} "
          f"{step['median_s']['secure (ember)'] * 1e3:10.1f} "
          f"{step['median_s']['non-secure (torch)'] * 1e3:10.1f} {step['ratio_median']:7.3f}")
    print(f"{'  the same, secure noise fused (one pass)':46s} "
          f"{step['median_s']['secure (ember, fused noise)'] * 1e3:10.1f} "
          f"{step['median_s']['non-secure (torch)'] * 1e3:10.1f} {step['ratio_fused_median']:7.3f}")
    print(f"{f'secure noise, {n / 1e6:g} M values (best ms)':46s} "
          f"{noise['best_s']['ember'] * 1e3:10.1f} {noise['best_s']['torch.Generator'] * 1e3:10.1f} "
          f"{1 / noise['speedup_best']:7.3f}")
    print("ratio = ember / baseline (step goal <= 1.03; noise goal < 1). Shared CPU: noisy.")
    result = {"quick": args.quick, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "step": step, "noise": {"values": n, **noise}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


def _main_cuda(args, rounds: int) -> dict:
    from ember.csprng.cuda_backend import fast_path

    step = bench_step(rounds, 256, "cuda")
    med = step["median_s"]
    print(f"device {torch.cuda.get_device_name()}, ember CUDA path {fast_path()}")
    print(f"{'DP-SGD step, GroupNorm CNN 1.1M, batch 256':46s} {'ms':>10s} {'/ non-secure':>13s}")
    for name, v in med.items():
        print(f"{name:46s} {v * 1e3:10.2f} {v / med['non-secure (torch)']:13.3f}")
    print("goal: secure / non-secure <= 1.05")
    result = {"quick": args.quick, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "path": fast_path(), "step": step}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
