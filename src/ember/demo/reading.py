"""The written reading under each table and figure of the ``ember demo`` report, generated from
the numbers of the run (no winner is written by hand): what was compared, what won, by how much
with the seed spread, and what that means for a user. Also one line per subsystem on what it is
for."""

from __future__ import annotations

from typing import Any

from ember.demo.protocol import BASELINES, METHODS, TEST_SETS

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


def _std(cell: dict[str, Any]) -> float:
    return cell["std"] if cell["std"] is not None else 0.0


def _fmt(cell: dict[str, Any]) -> str:
    if cell["std"] is None:
        return f"{cell['mean']:.3f} (one pooled model)"
    return f"{cell['mean']:.3f}±{cell['std']:.3f}"


def best_method(table: dict[str, dict[str, Any]], metric: str,
                methods: tuple[str, ...] = METHODS) -> str:
    """The method of ``table`` (method -> metric -> summary) with the best mean ``metric``."""
    sign = 1.0 if _HIGHER[metric] else -1.0
    return max(methods, key=lambda m: sign * table[m][metric]["mean"])


def _compare(table: dict[str, dict[str, Any]], metric: str) -> tuple[str, str, float, bool]:
    """(best method, best baseline, |difference|, difference larger than the seed spread)."""
    best = best_method(table, metric)
    others = tuple(m for m in BASELINES if m != best) if best in BASELINES else BASELINES
    base = best_method(table, metric, others)
    a, b = table[best][metric], table[base][metric]
    diff = abs(a["mean"] - b["mean"])
    return best, base, diff, diff > _std(a) + _std(b)


def _meaning(best: str, base: str, clear: bool, metric: str) -> str:
    name = _NAMES[metric]
    if best in BASELINES:
        if clear:
            return (f"a plain SGD baseline ({best}) beat every weight-averaging method on {name}: "
                    "on data like this, tune and early-stop SGD before reaching for averaging.")
        return (f"no method beat the best plain SGD baseline on {name} by more than the seed "
                "spread: averaging bought nothing measurable here.")
    if clear:
        return (f"{best} improved {name} over the best plain SGD baseline by more than the seed "
                "spread: worth its cost when this metric matters.")
    return (f"{best} led on {name}, but by no more than the seed spread over the best plain SGD "
            f"baseline ({base}): not a reliable gain with this many seeds.")


def results_reading(results: dict[str, dict[str, dict[str, Any]]], n_seeds: int) -> list[str]:
    """One paragraph per test set for the results table."""
    out = [f"Compared: {', '.join(METHODS)}; mean ± std over {n_seeds} seeds (MultiSWAG pools "
           f"the seeds into one model). The strongest simple baselines are "
           f"{' and '.join(BASELINES)}; a difference counts as larger than the seed spread when it "
           "exceeds the sum of the two standard deviations."]
    for test_set in TEST_SETS:
        table = results[test_set]
        best, base, diff, clear = _compare(table, "accuracy")
        nbest, nbase, ndiff, nclear = _compare(table, "nll")
        spread = "larger than" if clear else "within"
        nspread = "larger than" if nclear else "within"
        out.append(
            f"On {test_set} test images, {best} had the highest accuracy "
            f"({_fmt(table[best]['accuracy'])}); "
            + (f"the best baseline, {base}, had {_fmt(table[base]['accuracy'])}"
               if best not in BASELINES else
               f"the other baseline, {base}, had {_fmt(table[base]['accuracy'])}")
            + f": a difference of {diff:.3f}, {spread} the seed spread. "
            f"Lowest NLL: {nbest} ({_fmt(table[nbest]['nll'])}) against {nbase} "
            f"({_fmt(table[nbase]['nll'])}), a difference of {ndiff:.3f}, {nspread} the seed "
            f"spread. For a user: {_meaning(best, base, clear, 'accuracy')} "
            f"{_meaning(nbest, nbase, nclear, 'nll')}")
    return out


def reliability_reading(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The reading under the reliability diagrams (lowest and highest mean ECE per test set)."""
    parts = []
    for test_set in TEST_SETS:
        table = results[test_set]
        lo = best_method(table, "ece")
        hi = min(METHODS, key=lambda m: -table[m]["ece"]["mean"])
        parts.append(f"{test_set}: best calibrated {lo} (ECE {_fmt(table[lo]['ece'])}), worst "
                     f"{hi} ({_fmt(table[hi]['ece'])})")
    return ("Points on the diagonal are calibrated; below it, over-confident. Every method of the "
            "table is drawn, MultiSWAG included. " + "; ".join(parts) + ". For a user: pick "
            "the method by the calibration on the data you expect, since the order can change "
            "with the shift.")


def shift_reading(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The reading under the accuracy/NLL-against-shift figure."""
    drops = {m: min(results[t][m]["accuracy"]["mean"] for t in TEST_SETS[1:])
             - results[TEST_SETS[0]][m]["accuracy"]["mean"] for m in METHODS}
    least = max(METHODS, key=lambda m: drops[m])
    most = min(METHODS, key=lambda m: drops[m])
    return (f"Accuracy lost from clean to the worst shifted test set: smallest for {least} "
            f"({drops[least]:+.3f}), largest for {most} ({drops[most]:+.3f}). For a user: "
            "robustness to these shifts follows the clean-set ranking unless the drops differ "
            "by more than the error bars.")


def curves_reading(histories: dict[str, list[list[dict]]], stopped: list[int]) -> str:
    """The reading under the learning curves: where the SGD iterate peaked, where it ended, and
    the epochs early stopping kept."""
    parts = []
    for name, runs in histories.items():
        if not runs or "eval_accuracy" not in runs[0][0]:
            continue
        n = min(len(h) for h in runs)
        mean = [sum(h[e]["eval_accuracy"] for h in runs) / len(runs) for e in range(n)]
        peak = max(range(n), key=lambda e: mean[e])
        parts.append(f"{name}: clean test accuracy peaked at {mean[peak]:.3f} in epoch "
                     f"{peak + 1} and ended at {mean[-1]:.3f} (epoch {n}, mean over seeds)")
    kept = ", ".join(str(e + 1) for e in stopped)
    return ("; ".join(parts) + f". Early stopping on the noisy validation split kept epoch(s) "
            f"{kept}. For a user: with noisy labels the iterate first learns the clean signal, "
            "then memorises the wrong labels; a held-out split finds the peak without clean "
            "labels.")


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
