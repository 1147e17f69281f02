"""update_bn leaves the model's statistics as they were when it cannot compute new ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.swa import update_bn


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    m.train()
    for _ in range(3):
        m(torch.randn(8, 4) * 3 + 2)
    return m


def test_an_empty_loader_raises_and_keeps_the_statistics():
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="no batches"):
        update_bn([], m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_failing_forward_keeps_the_statistics():
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError):
        update_bn([torch.randn(8, 5)], m)  # wrong input width: the forward fails
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
