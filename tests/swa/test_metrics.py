"""Metrics and the reliability diagram on cases small enough to compute by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ember.swa import (
    accuracy,
    brier_score,
    calibration_bins,
    expected_calibration_error,
    nll,
    predictive_entropy,
    reliability_diagram,
)

PROBS = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
LABELS = torch.tensor([0, 1, 1, 0])  # correct, wrong, correct, wrong


def test_accuracy():
    assert accuracy(PROBS, LABELS) == 0.5


def test_nll_is_mean_negative_log_of_true_class():
    expected = -(math.log(0.9) + math.log(0.4) + math.log(0.7) + math.log(0.2)) / 4
    assert nll(PROBS, LABELS) == pytest.approx(expected)
    assert nll(torch.tensor([[1.0, 0.0]]), torch.tensor([1])) == pytest.approx(-math.log(1e-12))


def test_brier_score():
    # rows: (0.1^2 + 0.1^2), (0.6^2 + 0.6^2), (0.3^2 + 0.3^2), (0.8^2 + 0.8^2)
    expected = (0.02 + 0.72 + 0.18 + 1.28) / 4
    assert brier_score(PROBS, LABELS) == pytest.approx(expected)


def test_predictive_entropy():
    got = predictive_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]]))
    expected = [math.log(2), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)


def test_ece_equal_width_bins():
    # confidences away from bin edges: 0.95 (right), 0.65 (wrong), 0.75 (right), 0.85 (wrong)
    probs = torch.tensor([[0.95, 0.05], [0.65, 0.35], [0.25, 0.75], [0.15, 0.85]])
    # 2 bins (0, .5], (.5, 1]: one bin holding everything, |0.5 - 0.8| = 0.3
    ece = expected_calibration_error(probs, LABELS, n_bins=2, binning="width")
    assert ece == pytest.approx(0.3)
    # 10 bins, one row each: |0 - .65|, |1 - .75|, |0 - .85|, |1 - .95|
    ece = expected_calibration_error(probs, LABELS, n_bins=10, binning="width")
    assert ece == pytest.approx((0.65 + 0.25 + 0.85 + 0.05) / 4)
    bins = calibration_bins(probs, LABELS, n_bins=10, binning="width")
    np.testing.assert_allclose(bins.lower.numpy(), [0.6, 0.7, 0.8, 0.9])
    assert bins.accuracy.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_ece_equal_mass_bins():
    # sorted confidences 0.6 (w), 0.7 (c) | 0.8 (w), 0.9 (c): each bin |0.5 - mean conf|
    expected = 0.5 * abs(0.5 - 0.65) + 0.5 * abs(0.5 - 0.85)
    assert expected_calibration_error(PROBS, LABELS, n_bins=2, binning="mass") == pytest.approx(
        expected
    )
    bins = calibration_bins(PROBS, LABELS, n_bins=3, binning="mass")  # sizes 2, 1, 1
    assert bins.count.tolist() == [2, 1, 1]


def test_perfectly_calibrated_case_has_zero_ece():
    probs = torch.tensor([[0.5, 0.5]] * 4)
    labels = torch.tensor([0, 1, 0, 1])  # argmax is class 0: right half of the time at 0.5
    assert expected_calibration_error(probs, labels, n_bins=5, binning="width") == pytest.approx(0)


def test_numpy_inputs_are_accepted():
    assert accuracy(PROBS.numpy(), LABELS.numpy()) == 0.5


def test_bad_inputs():
    with pytest.raises(ValueError, match="shape"):
        accuracy(torch.tensor([0.5, 0.5]), torch.tensor([0]))
    with pytest.raises(ValueError, match="labels must have shape"):
        nll(PROBS, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"lie in \[0, 1\]"):
        nll(PROBS, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="integer class"):
        nll(PROBS, torch.tensor([0.0, 1.0, 1.0, 0.0]))
    with pytest.raises(ValueError, match="binning"):
        expected_calibration_error(PROBS, LABELS, binning="quantile")
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(PROBS, LABELS, n_bins=0)


def test_reliability_diagram_writes_a_png(tmp_path):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(200, 5, generator=g) * 2, 1)
    labels = torch.randint(0, 5, (200,), generator=g)
    out = reliability_diagram(probs, labels, tmp_path / "rel.png", n_bins=10, binning="width")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
