"""PrivacyConfig(max_epsilon=): the run stops right after the last step within the bound,
wherever it falls, returns normally, and a resume of it returns at once."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")

from ember.train import ConfigError, TrainConfig, fit  # noqa: E402
from ember.train.privacy import PrivacyConfig  # noqa: E402

N, BATCH = 48, 12  # 4 logical steps per epoch
SIGMA, DELTA = 1.0, 1e-5


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g),
                                          torch.randint(0, 2, (N,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loader


def _epsilon_after(steps: int) -> float:
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(SIGMA, BATCH / N, steps)]
    return float(acc.get_epsilon(DELTA))


def _fit(max_epsilon: float, epochs: int = 5, **kw):
    model, opt, loader = _setup()
    privacy = PrivacyConfig(noise_multiplier=SIGMA, delta=DELTA, max_grad_norm=1.0,
                            max_epsilon=max_epsilon)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # flat keywords: the same test runs on the versions before the groups
        return fit(model, opt, loader, TrainConfig(epochs=epochs, progress=False, **kw),
                   privacy=privacy)


@pytest.mark.parametrize("allowed", [4, 6, 8])  # epoch ends (4, 8) and mid-epoch (6)
def test_the_run_stops_after_the_last_step_under_the_bound(allowed):
    bound = (_epsilon_after(allowed) + _epsilon_after(allowed + 1)) / 2
    result = _fit(bound)
    assert result.steps == allowed
    assert result.stopped_early and result.privacy["stopped_early"]
    assert result.epsilon <= bound < _epsilon_after(allowed + 1)
    assert result.epsilon == pytest.approx(_epsilon_after(allowed))
    assert len(result.history) == -(-allowed // 4)  # the last (partial) epoch is recorded


def test_a_budget_stopped_run_resumes_to_its_end_at_once(tmp_path):
    bound = (_epsilon_after(4) + _epsilon_after(5)) / 2
    first = _fit(bound, checkpoint_dir=tmp_path)
    again = _fit(bound, checkpoint_dir=tmp_path, resume="auto")
    assert first.steps == again.steps == 4
    assert again.stopped_early and again.epsilon == first.epsilon
    assert again.history == first.history


def test_a_bound_below_one_step_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"max_epsilon=.*below the epsilon of one step"):
        _fit(_epsilon_after(1) / 2)


def test_continuing_a_run_whose_budget_is_reached_returns_at_once(tmp_path):
    first = _fit(None, epochs=1, checkpoint_dir=tmp_path)  # 4 steps, no bound
    bound = (_epsilon_after(4) + _epsilon_after(5)) / 2  # the next step would pass it
    again = _fit(bound, epochs=3, checkpoint_dir=tmp_path, resume="auto")
    assert again.steps == first.steps == 4 and again.stopped_early
    tighter = _fit(_epsilon_after(2), epochs=3, checkpoint_dir=tmp_path, resume="auto")
    assert tighter.steps == 4 and tighter.stopped_early  # already past it: nothing more


def test_a_stop_inside_the_last_epoch_is_an_early_stop():
    bound = (_epsilon_after(6) + _epsilon_after(7)) / 2
    result = _fit(bound, epochs=2)  # 8 steps planned, 6 taken
    assert result.steps == 6 and result.stopped_early
