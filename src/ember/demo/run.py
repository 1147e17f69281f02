"""``ember demo``: :func:`run_demo` runs the experiment of :mod:`ember.demo.protocol`, prints its
tables, and writes results.json, the figures and report.html; :func:`register` adds the command
to ``ember``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember.demo.figures import _plot_curves, _plot_reliability, _plot_shift, _plot_speed
from ember.demo.protocol import (
    DEFAULT_OUT,
    METHODS,
    PROTOCOL,
    TEST_SETS,
    DemoSettings,
    _batches,
    _csprng_speed,
    _dp_section,
    _early_stopped,
    _metrics,
    _probs,
    _read_all,
    _shards_speed,
    _split,
    _summary,
    _torch_generator,
    _train_seed,
    shifted_test_sets,
    write_digits_shards,
)
from ember.demo.reading import (
    SUBSYSTEMS,
    curves_reading,
    dp_reading,
    reliability_reading,
    results_reading,
    shift_reading,
    speed_reading,
)
from ember.demo.report import _format_protocol, _format_speed, _write_report, format_results

__all__ = ["register", "run_demo"]


def run_demo(out: Path = DEFAULT_OUT, *, quick: bool = False, progress: bool = True,
             benchmark: bool = True, dp: bool = True,
             settings: DemoSettings | None = None) -> dict[str, Any]:
    """Run the demo, print the protocol and tables, write results.json, the figures and
    report.html under ``out``; returns the results.json payload."""
    settings = settings or (DemoSettings.quick() if quick else DemoSettings())
    threads = torch.get_num_threads()
    # the models are tiny ((32, 128) activations): with several intra-op threads every op pays
    # thread start-up and, on a busy machine, waits for a core (measured 17-55 ms per step with 2
    # threads against 1 ms with one); the speed section below runs with the caller's threads
    torch.set_num_threads(1)
    try:
        return _run(out, settings, progress, benchmark, dp, threads)
    finally:
        torch.set_num_threads(threads)


def _run(out: Path, settings: DemoSettings, progress: bool, benchmark: bool, dp: bool,
         threads: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print(_format_protocol(settings), flush=True)
    shards = write_digits_shards(out / "shards", noise_rate=PROTOCOL["label_noise_rate"])
    print(f"\nwrote {shards['n_train']} train digits ({shards['noise_rate']:.1%} labels wrong) "
          f"and {shards['n_test']} test digits as PNG+cls shards to {out / 'shards'}", flush=True)

    x_test, y_test = _read_all(shards["test"])
    inputs = shifted_test_sets(x_test)
    n_test = len(y_test)
    all_x = torch.cat([inputs[t] for t in TEST_SETS])
    all_batches = _batches(all_x, y_test.repeat(len(TEST_SETS)))
    eval_batches = _batches(x_test, y_test)
    x_train, y_train = _read_all(shards["train"])
    bn_batches = _batches(x_train, y_train, 32)  # training inputs for BatchNorm recomputation

    per_seed, pooled, histories, stopped = _seed_runs(
        settings, shards, (all_batches, eval_batches, bn_batches), (x_train, y_train), y_test,
        out, progress)
    t_experiment = time.perf_counter() - t0

    results = {t: {m: {k: _summary([r[k] for r in per_seed[m][t]])
                       for k in ("accuracy", "nll", "ece", "confidence")} for m in METHODS}
               for t in TEST_SETS}
    print("\n" + format_results(results), flush=True)
    for paragraph in results_reading(results, len(settings.seeds)):
        print("\n" + paragraph, flush=True)

    payload: dict[str, Any] = {
        "protocol": settings.protocol(), "settings": asdict(settings) | {"swa_start": settings.swa_start},
        "data": {"n_train": shards["n_train"], "n_test": n_test,
                 "label_noise_rate_written": shards["noise_rate"]},
        "results": results,
        "early_stopping_epochs": stopped,  # 1-based
        "machine": f"{platform.machine()}, training on 1 torch thread, speed on {threads}, "
                   f"torch {torch.__version__}",
    }

    dp_payload, speed = _dp_and_speed(payload, settings, shards, (x_test, y_test), dp, benchmark,
                                      threads)

    figures: dict[str, Path] = {}
    if settings.seeds:
        figures["reliability"] = _plot_reliability(
            {m: {t: torch.cat(v) for t, v in d.items()} for m, d in pooled.items()}, y_test,
            out / "reliability.png")
    figures |= {
        "shift": _plot_shift(results, out / "shift.png"),
        "curves": _plot_curves(histories, settings.swa_start, stopped,
                               out / "learning_curves.png"),
    }
    if benchmark:
        figures["speed"] = _plot_speed(speed["csprng"], speed["shards"], out / "speed.png")
    payload["seconds"] = {"experiment": t_experiment, "total": time.perf_counter() - t0}
    payload["figures"] = {k: str(v) for k, v in figures.items()}
    payload["reading"] = {
        "results": results_reading(results, len(settings.seeds)),
        "reliability": reliability_reading(results),
        "shift": shift_reading(results),
        "curves": curves_reading(histories, stopped),
        "dp": dp_reading(dp_payload),
        "speed": speed_reading(speed),
        "subsystems": SUBSYSTEMS,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    report = _write_report(out / "report.html", payload,
                           figures,
                           settings)
    print(f"\nfigures: {', '.join(str(p) for p in figures.values())}")
    print(f"results: {out / 'results.json'}")
    print(f"demo finished in {payload['seconds']['total']:.1f} s")
    print(f"report: {report.resolve()}")
    return payload


def _seed_runs(settings: DemoSettings, shards: dict[str, Any], batches: tuple[list, list, list],
               train: tuple[torch.Tensor, torch.Tensor], y_test: torch.Tensor, out: Path,
               progress: bool) -> tuple[dict, dict, dict, list[int]]:
    """Train every seed's runs and evaluate every method; returns the per-seed metrics, the pooled
    probabilities, the learning curves and the early-stopping epochs (1-based)."""
    from ember.csprng import create_generator
    from ember.swa import MultiSWAG, bayesian_average

    all_batches, eval_batches, bn_batches = batches
    x_train, y_train = train
    n_test = len(y_test)
    per_seed: dict[str, dict[str, list[dict]]] = {m: {t: [] for t in TEST_SETS} for m in METHODS}
    pooled: dict[str, dict[str, list[torch.Tensor]]] = {m: {t: [] for t in TEST_SETS}
                                                       for m in METHODS}
    histories: dict[str, list[list[dict]]] = {"SGD, cosine LR": [], "SWA run": [],
                                              "SGD, early-stopped run": []}
    stopped: list[int] = []
    swags: list = []
    last_model: torch.nn.Module | None = None
    for seed in settings.seeds:
        print(f"seed {seed}: training SGD (cosine) and the SWA run, {settings.epochs} epochs "
              "each, and early-stopped SGD ...", flush=True)
        runs = _train_seed(seed, settings, shards["train"], eval_batches, bn_batches, out, progress)
        sgd, swa = runs["sgd"], runs["swa"]
        histories["SGD, cosine LR"].append(sgd.history)
        histories["SWA run"].append(swa.history)
        early = _early_stopped(seed, settings, x_train, y_train, eval_batches)
        histories["SGD, early-stopped run"].append(early["history"])
        stopped.append(early["epoch"] + 1)  # 1-based, as everywhere in the report
        probs = {"SGD (cosine LR)": _probs(sgd.model, all_batches),
                 "SGD (early-stopped)": _probs(early["model"], all_batches),
                 "SGD (SWA run, final iterate)": _probs(swa.model, all_batches),
                 "SWA": _probs(swa.swa.module, all_batches),
                 "SWAG": bayesian_average(swa.model, swa.swag, [b[0] for b in all_batches],
                                          settings.swag_samples, bn_loader=bn_batches,
                                          scale=PROTOCOL["swag_scale"],
                                          generator=_torch_generator(
                                              create_generator(seed).fold_in(11)))}
        for method, p in probs.items():
            for test_set, q in _split(p, n_test).items():
                per_seed[method][test_set].append(_metrics(q, y_test))
                pooled[method][test_set].append(q)
        swags.append(swa.swag)
        last_model = swa.model
    if last_model is None:
        raise ValueError("the demo needs at least one seed")
    print("MultiSWAG: pooling the seeds' SWAG posteriors ...", flush=True)
    p_multi = bayesian_average(last_model, MultiSWAG(swags), [b[0] for b in all_batches],
                               settings.swag_samples, bn_loader=bn_batches,
                               scale=PROTOCOL["swag_scale"],
                               generator=_torch_generator(create_generator(99).fold_in(11)))
    for test_set, q in _split(p_multi, n_test).items():
        per_seed["MultiSWAG"][test_set].append(_metrics(q, y_test))
        pooled["MultiSWAG"][test_set].append(q)
        # MultiSWAG's baseline at the same compute: the cosine-SGD seed models, outputs averaged
        ens = torch.stack(pooled["SGD (cosine LR)"][test_set]).mean(0)
        per_seed["SGD ensemble"][test_set].append(_metrics(ens, y_test))
        pooled["SGD ensemble"][test_set].append(ens)
    return per_seed, pooled, histories, stopped


def _dp_and_speed(payload: dict[str, Any], settings: DemoSettings, shards: dict[str, Any],
                  test: tuple[torch.Tensor, torch.Tensor], dp: bool, benchmark: bool,
                  threads: int) -> tuple[dict[str, Any] | None, dict[str, list]]:
    """The DP-SGD and speed sections: run them (where asked and possible), print them and record
    them in ``payload``; returns the DP section (None when skipped) and the speed rows."""
    x_test, y_test = test
    dp_payload = None
    if dp and importlib.util.find_spec("opacus") is not None:
        print(f"\nDP-SGD with Opacus, {settings.dp_epochs} epochs, non-secure then secure mode ...",
              flush=True)
        t_dp = time.perf_counter()
        dp_payload = _dp_section(shards["train"], (x_test, y_test), settings.dp_epochs)
        payload["dp"] = dp_payload
        payload["seconds_dp"] = time.perf_counter() - t_dp
        for r in dp_payload["runs"]:
            print(f"  secure_mode={r['secure_mode']!s:<5}  epsilon {r['epsilon']:.2f} (delta 1e-5)"
                  f"  clean test accuracy {r['accuracy']:.3f}  {r['train_seconds']:.2f} s")
        print(f"  secure mode took {dp_payload['secure_time_ratio']:.2f}x the time of non-secure "
              f"mode ({dp_payload['how']})")
    else:
        payload["dp_skipped"] = "opacus is not installed" if dp else "disabled (--no-dp)"
        print(f"\nDP-SGD section skipped: {payload['dp_skipped']}")

    speed: dict[str, list] = {"csprng": [], "shards": []}
    torch.set_num_threads(threads)
    if benchmark:
        print("\nspeed, measured now (other processes on this machine affect both sides):",
              flush=True)
        speed["csprng"] = _csprng_speed(settings)
        speed["shards"] = _shards_speed(shards["train"], shards["n_train"], settings.bench_passes)
        print(_format_speed(speed["csprng"], speed["shards"]))
    payload["speed"] = speed
    return dp_payload, speed


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ember demo`` to the ``ember`` command."""
    p = sub.add_parser(
        "demo", help="a pre-specified SGD/SWA/SWAG experiment on noisy digits, DP-SGD, speed; "
        "writes report.html",
        description="Write scikit-learn's bundled digits as tar shards (40% of the training "
        "labels wrong), stream them with an ember.csprng shuffle, train SGD (cosine), "
        "early-stopped SGD and SWA runs for several seeds, and compare them with SWAG and "
        "MultiSWAG on clean, noisy and "
        "rotated test images (accuracy, NLL, ECE); train with DP-SGD through Opacus using "
        "ember's generator; measure ember.csprng and ember.shards speed ratios. Writes "
        "results.json, PNG figures and a self-contained report.html.")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"output directory (default: ./{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="fewer epochs, 2 seeds, small SWAG (for tests; under a minute)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-benchmark", action="store_true", help="skip the speed measurements")
    p.add_argument("--no-dp", action="store_true", help="skip the DP-SGD section")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    missing = [m for m in ("sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if not args.no_benchmark and importlib.util.find_spec("webdataset") is None:
        missing.append("webdataset")
    if missing:
        print(f"ember demo: error: needs {' and '.join(missing)}; install them with "
              "pip install 'ember[demo]'", file=sys.stderr)
        return 2
    try:  # an --out that cannot be written is found before the minutes of work, not after
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / f".ember-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        print(f"ember demo: error: --out {args.out}: cannot write there "
              f"({exc.strerror or exc})", file=sys.stderr)
        return 2
    try:
        run_demo(args.out, quick=args.quick, progress=not args.no_progress,
                 benchmark=not args.no_benchmark, dp=not args.no_dp)
    except OSError as exc:  # e.g. the disk filled up while writing the outputs
        print(f"ember demo: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
