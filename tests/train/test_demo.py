"""``ember demo --quick`` runs the whole stack and writes the results and report it says it writes.

The checks are on structure (every table entry present and a valid number, every embedded image a
decodable PNG), never on the values the demo measured.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ember.cli import main
from ember.demo import METHODS, TEST_SETS

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--quick", "--out", str(out), "--no-progress"])
    return rc, out, buf.getvalue()


def _is_prob(x) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def test_demo_exits_zero_and_prints_protocol_before_numbers(demo_run):
    rc, out, text = demo_run
    assert rc == 0
    protocol_at = text.index("Pre-specified protocol")
    table_at = text.index("accuracy")
    assert protocol_at < table_at
    for method in METHODS:
        assert method in text
    assert "40% of training labels" in text
    # the report's path is printed last
    last = text.strip().splitlines()[-1]
    assert last == f"report: {(out / 'report.html').resolve()}"


def test_results_json_holds_every_table_entry(demo_run):
    _, out, _ = demo_run
    payload = json.loads((out / "results.json").read_text())
    assert payload["protocol"]["label_noise_rate"] == 0.4
    assert payload["data"]["label_noise_rate_written"] == pytest.approx(0.4, abs=1e-3)
    seeds = payload["settings"]["seeds"]
    assert len(seeds) >= 2
    results = payload["results"]
    assert set(results) == set(TEST_SETS)
    for test_set in TEST_SETS:
        assert set(results[test_set]) == set(METHODS)
        for method in METHODS:
            for metric in ("accuracy", "nll", "ece"):
                s = results[test_set][method][metric]
                n = 1 if method == "MultiSWAG" else len(seeds)
                assert len(s["per_seed"]) == n
                assert math.isclose(s["mean"], sum(s["per_seed"]) / n, rel_tol=1e-9)
                assert (s["std"] is None) == (n == 1)
                if metric == "nll":
                    assert all(v > 0 and math.isfinite(v) for v in s["per_seed"])
                else:
                    assert all(_is_prob(v) for v in s["per_seed"])
    for row in payload["speed"]["csprng"]:
        assert row["case"] in {"rand float32", "randn float32", "randint int64"}
        # the median of interleaved per-repetition ratios, inside their range
        assert 0 < row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    assert {r["case"] for r in payload["speed"]["csprng"]} == {"rand float32", "randn float32",
                                                               "randint int64"}
    (shards,) = payload["speed"]["shards"]
    assert shards["ratio"] == pytest.approx(shards["ember_per_s"] / shards["webdataset_per_s"])
    dp = payload["dp"]
    assert [r["secure_mode"] for r in dp["runs"]] == [False, True]
    for r in dp["runs"]:
        assert r["epsilon"] > 0 and _is_prob(r["accuracy"]) and r["train_seconds"] > 0
    assert dp["secure_time_ratio"] == pytest.approx(
        dp["runs"][1]["train_seconds"] / dp["runs"][0]["train_seconds"])
    for path in payload["figures"].values():
        assert Path(path).read_bytes()[:8] == PNG


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.tables, self.cells, self.headings = [], 0, [], []
        self._in = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        elif tag == "table":
            self.tables += 1
        elif tag in ("td", "h2"):
            self._in = tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in == "td":
            self.cells.append(data)
        elif self._in == "h2":
            self.headings.append(data)


def test_report_is_self_contained_and_every_image_decodes(demo_run):
    from PIL import Image

    _, out, _ = demo_run
    page = _Page()
    page.feed((out / "report.html").read_text(encoding="utf-8"))
    assert len(page.images) == 4  # reliability, shift, learning curves, speed
    for src in page.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix), "images must be embedded, not linked"
        with Image.open(io.BytesIO(base64.b64decode(src[len(prefix):]))) as im:
            im.load()
            assert im.width > 200 and im.height > 200
            assert sum(1 for c in im.convert("L").histogram() if c) > 10  # a drawing, not a blank page
    assert page.tables == 3  # results, DP, speed
    for method in METHODS:
        assert method in page.cells
    assert any("Protocol" in h for h in page.headings)


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium installed (chromium, "
                    "chromium-browser or google-chrome on PATH); the page is still checked by "
                    "test_report_is_self_contained_and_every_image_decodes")
def test_report_renders_in_headless_chromium(demo_run, tmp_path):
    from PIL import Image

    _, out, _ = demo_run
    shot = tmp_path / "shot.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={shot}", "--window-size=1400,3000",
                    (out / "report.html").resolve().as_uri()],
                   check=True, timeout=120, capture_output=True)
    with Image.open(shot) as im:
        gray = im.convert("L")
        lo, hi = gray.getextrema()
        assert hi - lo > 100  # text and plots, not an empty page
        histogram = gray.histogram()
        assert sum(histogram[:128]) > 0.001 * sum(histogram)


def test_reading_names_the_best_method_of_its_own_table(demo_run):
    # issue 28: the report's reading is generated from the numbers; for every test set it names
    # the method with the best mean accuracy and the one with the lowest mean NLL of the table
    from ember.demo.reading import best_method

    _, out, text = demo_run
    payload = json.loads((out / "results.json").read_text())
    results, reading = payload["results"], payload["reading"]
    page = (out / "report.html").read_text(encoding="utf-8")
    for test_set in TEST_SETS:
        table = results[test_set]
        best = max(METHODS, key=lambda m: table[m]["accuracy"]["mean"])
        lowest = min(METHODS, key=lambda m: table[m]["nll"]["mean"])
        assert best_method(table, "accuracy") == best and best_method(table, "nll") == lowest
        (sentence,) = [p for p in reading["results"] if p.startswith(f"On {test_set} test")]
        assert f"On {test_set} test images, {best} had the highest accuracy" in sentence
        assert f"Lowest NLL: {lowest} (" in sentence
        assert html.escape(sentence) in page and sentence in text
    lowest_ece = {t: min(METHODS, key=lambda m: results[t][m]["ece"]["mean"]) for t in TEST_SETS}
    for t, m in lowest_ece.items():
        assert f"{t}: best calibrated {m} (" in reading["reliability"]
    for name in ("ember.csprng", "ember.shards", "ember.swa", "ember.train"):
        assert name in reading["subsystems"] and name in page


def test_early_stopping_baseline_and_multiswag_are_reported(demo_run):
    _, out, _ = demo_run
    payload = json.loads((out / "results.json").read_text())
    assert "SGD (early-stopped)" in METHODS and "MultiSWAG" in METHODS
    epochs = payload["early_stopping_epochs"]
    assert len(epochs) == len(payload["settings"]["seeds"])
    assert all(0 <= e < payload["settings"]["epochs"] for e in epochs)
    assert "early_stopping" in payload["protocol"]
