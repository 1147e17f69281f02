"""The written reading under each table and figure of the ``ember demo`` report, generated from
the numbers of the run (no winner is written by hand): what was compared, what won, by how much
with the seed spread, and what that means for a user. Also one line per subsystem on what it is
for."""

from __future__ import annotations

from typing import Any

from ember.demo.protocol import AVERAGING, BASELINES, METHODS, SINGLE_METHODS, TEST_SETS

__all__ = ["SUBSYSTEMS", "best_method", "curves_reading", "dp_reading", "reliability_reading",
           "results_reading", "shift_reading", "speed_reading"]

SUBSYSTEMS = {
    "ember.csprng": "cryptographically secure, reproducible random numbers for torch (here: the "
                    "data shuffle and Opacus's secure noise), with torch's generator interface.",
    "ember.shards": "streaming datasets stored as tar shards (webdataset's format) with exact "
                    "resumption and seeded shuffles (here: the digits are written and read back).",
    "ember.swa": "weight averaging and weight-space posteriors (SWA, EMA, SWAG, MultiSWAG, "
                 "fast-SWA, SWALP, SWAP, subspace inference) and calibration metrics.",
    "ember.train": "one training loop (fit) with mixed precision, checkpoint/resume, DDP, "
                   "SWA/SWAG collection and DP-SGD (here: every model but the early-stopped one).",
}

_HIGHER = {"accuracy": True, "nll": False, "ece": False}
_NAMES = {"accuracy": "accuracy", "nll": "NLL", "ece": "ECE"}


def _std(cell: dict[str, Any]) -> float | None:
    return cell["std"]


def _fmt(cell: dict[str, Any]) -> str:
    if cell["std"] is None:
        return f"{cell['mean']:.3f} (one pooled model)"
    return f"{cell['mean']:.3f}±{cell['std']:.3f}"


def best_method(table: dict[str, dict[str, Any]], metric: str,
                methods: tuple[str, ...] = SINGLE_METHODS) -> str:
    """The method of ``table`` (method -> metric -> summary) with the best mean ``metric``
    (by default among the per-seed methods: pooled ones are compared with each other)."""
    sign = 1.0 if _HIGHER[metric] else -1.0
    return max(methods, key=lambda m: sign * table[m][metric]["mean"])


def _tied(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Means equal at the three digits the report prints."""
    return f"{a['mean']:.3f}" == f"{b['mean']:.3f}"


def _compare(table: dict[str, dict[str, Any]], metric: str) -> tuple[str, str, float, bool | None]:
    """(best per-seed method, its rival, |difference|, difference larger than the seed spread;
    ``None`` when a spread is missing). The rival of a baseline is the best weight-averaging
    method, that of any other method the best baseline."""
    best = best_method(table, metric)
    # a plain SGD model (a baseline or the SWA run's final iterate) is compared with the best
    # weight-averaging method; an averaging method with the best baseline
    rival = best_method(table, metric, AVERAGING if best not in AVERAGING else BASELINES)
    a, b = table[best][metric], table[rival][metric]
    diff = abs(a["mean"] - b["mean"])
    std_a, std_b = _std(a), _std(b)
    if std_a is None or std_b is None:
        return best, rival, diff, None
    return best, rival, diff, diff > std_a + std_b


def _meaning(best: str, rival: str, clear: bool | None, tie: bool, metric: str) -> str:
    name = _NAMES[metric]
    if clear is None:
        return f"with one seed there is no spread to judge the {name} difference by."
    if tie or not clear:
        lead = f"{best} and {rival} tie on {name}" if tie else \
            f"{best} led on {name}, but by no more than the seed spread over {rival}"
        return lead + ": no measurable difference with this many seeds."
    if best not in AVERAGING:
        return (f"a plain SGD baseline ({best}) beat the best weight-averaging method ({rival}) "
                f"on {name} by more than the seed spread: on data like this, tune and "
                "early-stop SGD before reaching for averaging.")
    return (f"{best} improved {name} over the best plain SGD baseline ({rival}) by more than the "
            "seed spread: a measurable gain on this metric.")


def _sentence(table: dict[str, dict[str, Any]], metric: str) -> tuple[str, str]:
    best, rival, diff, clear = _compare(table, metric)
    tie = _tied(table[best][metric], table[rival][metric])
    role = "the best weight-averaging method" if best not in AVERAGING else "the best baseline"
    spread = {True: "larger than the seed spread", False: "within the seed spread",
              None: "no seed spread (one seed)"}[clear]
    if tie:
        head = (f"{best} and {rival} ({role}) tie on {_NAMES[metric]} "
                f"({_fmt(table[best][metric])} and {_fmt(table[rival][metric])})")
    else:
        level = [m for m in SINGLE_METHODS if m not in (best, rival)
                 and _tied(table[m][metric], table[best][metric])]
        head = (f"{best} had the {'highest' if _HIGHER[metric] else 'lowest'} {_NAMES[metric]} "
                f"({_fmt(table[best][metric])}"
                + (f", tied with {' and '.join(level)}" if level else "")
                + f"); {role}, {rival}, had "
                f"{_fmt(table[rival][metric])}: a difference of {diff:.3f}, {spread}")
    return head, _meaning(best, rival, clear, tie, metric)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _pooled_sentence(table: dict[str, dict[str, Any]]) -> str:
    """MultiSWAG against the SGD ensemble: the same training runs, one pooled model each."""
    parts = []
    for metric in ("accuracy", "nll"):
        a, b = table["MultiSWAG"][metric], table["SGD ensemble"][metric]
        if _tied(a, b):
            parts.append(f"MultiSWAG and the SGD ensemble tie on {_NAMES[metric]} "
                         f"({a['mean']:.3f})")
            continue
        better = (a["mean"] > b["mean"]) == _HIGHER[metric]
        parts.append(f"{_NAMES[metric]} {a['mean']:.3f} for MultiSWAG against {b['mean']:.3f} "
                     f"for the SGD ensemble ({'MultiSWAG' if better else 'the SGD ensemble'} "
                     f"ahead by {abs(a['mean'] - b['mean']):.3f})")
    return ("At the same compute (every seed's run, pooled): " + "; ".join(parts) + ". Each is "
            "one pooled model, so there is no seed spread to test these differences against: "
            "read them as one observation, not as a measured gain.")


def results_reading(results: dict[str, dict[str, dict[str, Any]]], n_seeds: int) -> list[str]:
    """One paragraph per test set for the results table."""
    out = [f"Compared: {', '.join(METHODS)}; mean ± std over {n_seeds} seeds (the SGD ensemble "
           "averages the cosine-SGD seeds' softmax outputs and MultiSWAG pools the seeds' SWAGs: "
           "one model each, no std, compared with each other at the same compute). The strongest "
           f"simple baselines are {' and '.join(BASELINES)}; the best per-seed method is compared "
           "with the best baseline, or, when a baseline wins, with the best weight-averaging "
           f"method ({' or '.join(AVERAGING)}); a difference counts as larger than the seed "
           "spread when it exceeds the sum of the two standard deviations."]
    for test_set in TEST_SETS:
        table = results[test_set]
        acc, acc_meaning = _sentence(table, "accuracy")
        nll, nll_meaning = _sentence(table, "nll")
        out.append(f"On {test_set} test images, {acc}. {_cap(nll)}. For a user: "
                   f"{_cap(acc_meaning)} {_cap(nll_meaning)} {_pooled_sentence(table)}")
    return out


def reliability_reading(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The reading under the reliability diagrams: lowest and highest mean ECE per test set, and
    which methods are over- or under-confident (mean confidence against accuracy)."""
    parts = []
    for test_set in TEST_SETS:
        table = results[test_set]
        lo = best_method(table, "ece", METHODS)
        hi = min(METHODS, key=lambda m: -table[m]["ece"]["mean"])
        over = [m for m in METHODS
                if table[m]["confidence"]["mean"] > table[m]["accuracy"]["mean"]]
        under = [m for m in METHODS if m not in over]
        side = []
        if over:
            side.append(f"over-confident (mean confidence above accuracy): {', '.join(over)}")
        if under:
            side.append(f"under-confident or exact: {', '.join(under)}")
        parts.append(f"{test_set}: best calibrated {lo} (ECE {_fmt(table[lo]['ece'])}), worst "
                     f"{hi} ({_fmt(table[hi]['ece'])}); " + "; ".join(side))
    return ("Points on the diagonal are calibrated; below it, over-confident. Every method of the "
            "table is drawn. " + ". ".join(parts) + ". For a user: pick the method by the "
            "calibration on the data you expect, since the order can change with the shift.")


def _drops(results: dict[str, dict[str, dict[str, Any]]], method: str) -> list[float]:
    """Per seed, accuracy on the worst shifted test set minus clean accuracy."""
    clean = results[TEST_SETS[0]][method]["accuracy"]["per_seed"]
    shifted = [results[t][method]["accuracy"]["per_seed"] for t in TEST_SETS[1:]]
    return [min(s[i] for s in shifted) - c for i, c in enumerate(clean)]


def shift_reading(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The reading under the accuracy/NLL-against-shift figure: which per-seed method lost the
    least accuracy under shift, and whether that differs from the worst by more than the spread."""
    import statistics

    drops = {m: _drops(results, m) for m in SINGLE_METHODS}
    mean = {m: statistics.fmean(d) for m, d in drops.items()}
    std = {m: statistics.stdev(d) if len(d) > 1 else None for m, d in drops.items()}
    least = max(SINGLE_METHODS, key=lambda m: mean[m])
    most = min(SINGLE_METHODS, key=lambda m: mean[m])
    text = (f"Accuracy lost from clean to the worst shifted test set (mean over seeds): smallest "
            f"for {least} ({mean[least]:+.3f}), largest for {most} ({mean[most]:+.3f}). ")
    std_least, std_most = std[least], std[most]
    if std_least is None or std_most is None:
        return text + "With one seed there is no spread to judge this by."
    gap = mean[least] - mean[most]
    spread = std_least + std_most
    if gap > spread:
        return text + (f"The gap ({gap:.3f}) is larger than the seed spread of the drops "
                       f"({spread:.3f}): {least} is measurably more robust to these shifts than "
                       f"{most}.")
    return text + (f"The gap ({gap:.3f}) is within the seed spread of the drops ({spread:.3f}): no "
                   "method is measurably more robust to these shifts.")


def curves_reading(histories: dict[str, list[list[dict]]], stopped: list[int]) -> str:
    """The reading under the learning curves: where each iterate peaked, whether it fell after
    the peak by more than the seed spread, and the epochs (1-based) early stopping kept."""
    import statistics

    parts, fell = [], []
    for name, runs in histories.items():
        if not runs or "eval_accuracy" not in runs[0][0]:
            continue
        n = min(len(h) for h in runs)
        mean = [sum(h[e]["eval_accuracy"] for h in runs) / len(runs) for e in range(n)]
        peak = max(range(n), key=lambda e: mean[e])
        finals = [h[n - 1]["eval_accuracy"] for h in runs]
        spread = statistics.stdev(finals) if len(finals) > 1 else None
        drop = mean[peak] - mean[-1]
        text = (f"{name}: clean test accuracy peaked at {mean[peak]:.3f} in epoch {peak + 1} and "
                f"ended at {mean[-1]:.3f} (epoch {n}, mean over seeds)")
        if peak < n - 1 and spread is not None and drop > spread:
            fell.append(name)
            text += f", a fall of {drop:.3f}, more than the seed spread ({spread:.3f})"
        parts.append(text)
    kept = ", ".join(str(e) for e in stopped)
    if fell:
        meaning = (f"accuracy fell after its peak in {', '.join(fell)}: the iterate first learned "
                   "the clean signal, then fitted the wrong labels; a held-out split finds the "
                   "peak without clean labels.")
    else:
        meaning = ("no curve fell after its peak by more than the seed spread, so in this run "
                   "there was no memorisation of the wrong labels for early stopping to avoid.")
    return ("; ".join(parts) + f". Early stopping on the noisy validation split kept epoch(s) "
            f"{kept} (1-based). For a user: " + meaning)


def dp_reading(dp: dict[str, Any] | None) -> str:
    """The reading under the DP-SGD table."""
    if dp is None:
        return "Not run in this report."
    plain, secure = dp["runs"]
    return (f"Both runs spend epsilon {secure['epsilon']:.2f} (delta 1e-5); clean test accuracy "
            f"{plain['accuracy']:.3f} without and {secure['accuracy']:.3f} with secure mode, "
            f"which took {dp['secure_time_ratio']:.2f}x the time. For a user: secure mode "
            "(ember.csprng as the noise source) is what makes the guarantee hold against an "
            "attacker who can predict torch's generator; this is its measured cost here.")


def speed_reading(speed: dict[str, list[dict]]) -> str:
    """The reading under the speed table."""
    if not speed["csprng"] and not speed["shards"]:
        return "Not measured (--no-benchmark)."
    parts = [f"{r['case']}: ember {r['ratio']:.2f}x torch's default generator"
             for r in speed["csprng"]]
    parts += [f"{r['case']}: ember.shards {r['ratio']:.2f}x webdataset" for r in speed["shards"]]
    return ("; ".join(parts) + ". Ratios above 1 mean ember is faster. Measured once in this run "
            "on a possibly busy machine; bench/ gives medians with spread.")
