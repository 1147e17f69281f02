"""``ember demo --quick`` runs the whole stack end to end and writes what it says it writes."""

from __future__ import annotations

import json

from ember.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    for row in ("SGD (final iterate)", "SWA", "SWAG (BMA, 5 samples)", "test acc", "NLL", "ECE",
                "ember.csprng throughput", "rand float32"):
        assert row in text
    for name in ("learning_curve.png", "reliability_swag.png", "reliability_sgd.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG
        assert str(path) in text
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"SGD (final iterate)", "SWA", "SWAG (BMA, 5 samples)"}
    for metrics in results.values():
        assert metrics["accuracy"] > 0.6  # 10 classes: chance is 0.1
        assert 0 <= metrics["ece"] <= 1 and metrics["nll"] > 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["event"] == "epoch"]
    assert len(epochs) == 6 and all("eval_accuracy" in r for r in epochs)
    assert [r["swa"] for r in epochs] == [False] * 3 + [True] * 3
    assert len(list((out / "shards").glob("train-*.tar"))) >= 2
