"""The ``ember demo`` text and HTML output: the protocol and results tables printed on stdout and
the self-contained report.html (figures embedded as PNG data)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from ember.demo.protocol import METHODS, PROTOCOL, TEST_SETS, DemoSettings


def _fmt(s: dict[str, Any], digits: int = 3) -> str:
    if s["std"] is None:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f}±{s['std']:.{digits}f}"


def format_results(results: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> str:
    """The experiment's table: one row per (test set, method), mean ± std over seeds."""
    head = f"{'test set':<13}{'method':<31}{'accuracy':>15}{'NLL':>15}{'ECE':>15}"
    lines = [head, "-" * len(head)]
    for test_set in TEST_SETS:
        for method in METHODS:
            m = results[test_set][method]
            lines.append(f"{test_set:<13}{method:<31}{_fmt(m['accuracy']):>15}"
                         f"{_fmt(m['nll']):>15}{_fmt(m['ece']):>15}")
    return "\n".join(lines)


def _format_speed(csprng_rows: list[dict], shard_rows: list[dict]) -> str:
    lines = [f"{'ember.csprng vs torch default':<34}{'ember GB/s':>11}{'torch GB/s':>11}"
             f"{'ratio':>8}"]
    for r in csprng_rows:
        lines.append(f"{r['case'] + ' ' + str(r['size_mib']) + ' MiB':<34}{r['ember_gbps']:>11.2f}"
                     f"{r['torch_gbps']:>11.2f}{r['ratio']:>7.2f}x")
    lines.append(f"{'ember.shards vs webdataset':<34}{'ember /s':>11}{'wds /s':>11}{'ratio':>8}")
    for r in shard_rows:
        lines.append(f"{r['case']:<34}{r['ember_per_s']:>11.0f}{r['webdataset_per_s']:>11.0f}"
                     f"{r['ratio']:>7.2f}x")
    return "\n".join(lines)


def _format_protocol(settings: DemoSettings) -> str:
    keys = ("data", "label_noise", "model", "optimizer", "baseline", "early_stopping", "swa", "swag",
            "multiswag", "sgd_ensemble", "seeds", "epochs", "metrics", "dp")
    protocol = settings.protocol()
    lines = ["Pre-specified protocol (fixed before any result was seen; sizes of this run):"]
    lines += [f"  {k}: {protocol[k]}" for k in keys]
    lines += [f"  test sets: {'; '.join(f'{k}: {v}' for k, v in PROTOCOL['test_sets'].items())}",
              f"  this run: {settings.epochs} epochs (SWA from epoch {settings.swa_start + 1}), "
              f"seeds {list(settings.seeds)}, SWAG rank {settings.swag_rank}, "
              f"{settings.swag_samples} samples"]
    return "\n".join(lines)


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _write_report(path: Path, payload: dict[str, Any], figures: dict[str, Path],
                  settings: DemoSettings) -> Path:
    def img(key: str, alt: str) -> str:
        data = base64.b64encode(figures[key].read_bytes()).decode("ascii")
        return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">' \
               f"<figcaption>{html.escape(alt)}</figcaption></figure>"

    reading = payload["reading"]

    def para(text: str) -> str:
        return f'<p class="reading">{html.escape(text)}</p>'

    res = payload["results"]
    rows = [[t, m, _fmt(res[t][m]["accuracy"]), _fmt(res[t][m]["nll"]), _fmt(res[t][m]["ece"])]
            for t in TEST_SETS for m in METHODS]
    protocol = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>"
                       for k, v in settings.protocol().items() if isinstance(v, str))
    protocol += "".join(f"<li><b>test set {html.escape(k)}</b>: {html.escape(v)}</li>"
                        for k, v in PROTOCOL["test_sets"].items())
    subsystems = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                         for k, v in reading["subsystems"].items())
    speed = payload["speed"]
    speed_rows = [[f"{r['case']} {r['size_mib']} MiB", f"{r['ember_gbps']:.2f} GB/s",
                   f"{r['torch_gbps']:.2f} GB/s", f"{r['ratio']:.2f}x"] for r in speed["csprng"]]
    speed_rows += [[r["case"], f"{r['ember_per_s']:.0f}/s", f"{r['webdataset_per_s']:.0f}/s",
                    f"{r['ratio']:.2f}x"] for r in speed["shards"]]
    dp = payload.get("dp")
    if dp is not None:
        dp_html = _html_table(
            ["mode", "epsilon (delta 1e-5)", "clean test accuracy", "training seconds"],
            [["secure_mode=True" if r["secure_mode"] else "secure_mode=False",
              f"{r['epsilon']:.2f}", f"{r['accuracy']:.3f}", f"{r['train_seconds']:.2f}"]
             for r in dp["runs"]])
        dp_html += (f"<p>secure mode took {dp['secure_time_ratio']:.2f}x the time of non-secure "
                    f"mode. Opacus's secure RNG: {html.escape(dp['how'])}.</p>")
    else:
        dp_html = f"<p>not run: {html.escape(payload.get('dp_skipped', 'disabled'))}</p>"
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ember demo report</title>
<style>
body {{ font-family: sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #bbb; padding: 3px 9px; text-align: right; }}
th {{ background: #eee; }} td:nth-child(-n+2) {{ text-align: left; }}
p.reading {{ max-width: 60em; background: #f6f6f0; padding: 0.5em 0.8em; }}
img {{ max-width: 100%; }} figure {{ margin: 1em 0; }} figcaption {{ color: #555; }}
</style></head><body>
<h1>ember demo: digits with noisy labels and shifted test sets</h1>
<p>{settings.epochs} epochs per run, seeds {list(settings.seeds)}; run took
{payload['seconds']['total']:.0f} s on {html.escape(payload['machine'])}.</p>
<h2>What each part of ember is for</h2><ul>{subsystems}</ul>
<h2>Protocol (fixed before any result)</h2><ul>{protocol}</ul>
<h2>Results (mean ± std over seeds)</h2>
{_html_table(["test set", "method", "accuracy", "NLL", "ECE"], rows)}
{"".join(para(t) for t in reading["results"])}
{img("reliability", "Reliability diagrams of every method on each test set (seeds pooled)")}
{para(reading["reliability"])}
{img("shift", "Accuracy and NLL against shift")}
{para(reading["shift"])}
{img("curves", "Learning curves (the early-stopped runs end when they stop)")}
{para(reading["curves"])}
<h2>Differentially private training (Opacus, ember.csprng as secure RNG)</h2>
{dp_html}
{para(reading["dp"])}
<h2>Speed measured in this run</h2>
{_html_table(["case", "ember", "baseline", "ratio"], speed_rows)}
{img("speed", "Speed ratios") if "speed" in figures else "<p>not measured (--no-benchmark)</p>"}
{para(reading["speed"])}
</body></html>
"""
    path.write_text(doc, encoding="utf-8")
    return path
