"""fit(callbacks=[...]): hooks called by name, their state kept in checkpoints, StopTraining."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ember.train import CheckpointConfig, LogConfig, StopTraining, TrainConfig, fit


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(20, 3, generator=g),
                                          torch.randint(0, 2, (20,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), \
        torch.utils.data.DataLoader(data, batch_size=5)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.seen_steps = 0

    def on_fit_start(self) -> None:
        self.calls.append(("fit_start",))

    def on_step_end(self, step: int, record: dict) -> None:
        self.calls.append(("step", step, record["step"]))
        self.seen_steps += 1

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        self.calls.append(("epoch", epoch, record["epoch"]))

    def on_fit_end(self, result) -> None:
        self.calls.append(("fit_end", result.steps))

    def state_dict(self) -> dict:
        return {"seen_steps": self.seen_steps}

    def load_state_dict(self, state: dict) -> None:
        self.seen_steps = state["seen_steps"]


def test_hooks_are_called_in_order_with_steps_and_epochs():
    model, opt, loader = _setup()
    rec = Recorder()
    result = fit(model, opt, loader, TrainConfig(2, log=LogConfig(progress=False)),
                 callbacks=[rec])
    assert rec.calls[0] == ("fit_start",)
    assert rec.calls[-1] == ("fit_end", 8)
    steps = [c[1] for c in rec.calls if c[0] == "step"]
    assert steps == list(range(1, 9)) and result.steps == 8
    assert [c for c in rec.calls if c[0] == "epoch"] == [("epoch", 0, 0), ("epoch", 1, 1)]
    # an epoch's hook comes after its last step's
    assert rec.calls.index(("epoch", 0, 0)) == rec.calls.index(("step", 4, 4)) + 1


def test_a_callbacks_state_is_kept_in_the_checkpoint_and_restored(tmp_path):
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(1, log=LogConfig(progress=False),
                                        checkpoint=CheckpointConfig(dir=tmp_path)),
        callbacks=[Recorder()])
    model, opt, loader = _setup()
    resumed = Recorder()
    fit(model, opt, loader, TrainConfig(3, log=LogConfig(progress=False),
                                        checkpoint=CheckpointConfig(dir=tmp_path,
                                                                    resume="auto")),
        callbacks=[resumed])
    assert resumed.seen_steps == 4 + 8  # restored 4, then two more epochs of 4


def test_stop_training_from_a_callback_ends_the_run_cleanly():
    class StopAt:
        def on_step_end(self, step: int, record: dict) -> None:
            if step == 3:
                raise StopTraining

    model, opt, loader = _setup()
    result = fit(model, opt, loader, TrainConfig(5, log=LogConfig(progress=False)),
                 callbacks=[StopAt()])
    assert result.steps == 3 and result.stopped_early
    assert len(result.history) == 1 and result.history[0]["batches"] == 3


def test_resuming_with_other_callbacks_is_refused(tmp_path):
    from ember.train import ConfigError

    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(1, log=LogConfig(progress=False),
                                        checkpoint=CheckpointConfig(dir=tmp_path)),
        callbacks=[Recorder(), Recorder()])
    model, opt, loader = _setup()
    with pytest.raises(ConfigError, match="callbacks"):
        fit(model, opt, loader, TrainConfig(2, log=LogConfig(progress=False),
                                            checkpoint=CheckpointConfig(dir=tmp_path,
                                                                        resume="auto")),
            callbacks=[Recorder()])


class Counter:
    def __init__(self) -> None:
        self.events = 0

    def on_step_end(self, step: int, record: dict) -> None:
        self.events += 1

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        self.events += 1

    def state_dict(self) -> dict:
        return {"events": self.events}

    def load_state_dict(self, state: dict) -> None:
        self.events = state["events"]


class Killed(Exception):
    pass


@pytest.mark.parametrize("every", [None])  # a DataLoader resumes at epoch ends only
def test_a_checkpoint_holds_the_callback_state_after_the_event_it_closes(tmp_path, every):
    whole = Counter()
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(3, log=LogConfig(progress=False)), callbacks=[whole])

    def kill(step: int, record: dict) -> None:
        if step == 6:
            raise Killed

    model, opt, loader = _setup()
    with pytest.raises(Killed):
        fit(model, opt, loader, TrainConfig(3, log=LogConfig(progress=False),
                                            checkpoint=CheckpointConfig(dir=tmp_path,
                                                                        every=every)),
            callbacks=[Counter()], on_step=kill)
    resumed = Counter()
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(3, log=LogConfig(progress=False),
                                        checkpoint=CheckpointConfig(dir=tmp_path, every=every,
                                                                    resume="auto")),
        callbacks=[resumed])
    assert resumed.events == whole.events == 12 + 3


def test_stop_training_from_one_callback_still_reaches_the_others():
    class Stop:
        def on_step_end(self, step: int, record: dict) -> None:
            if step == 2:
                raise StopTraining

    rec = Recorder()
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(2, log=LogConfig(progress=False)),
        callbacks=[Stop(), rec])
    assert ("step", 2, 2) in rec.calls and ("epoch", 0, 0) in rec.calls


def test_a_stateless_callback_added_on_resume_is_fine(tmp_path):
    model, opt, loader = _setup()
    fit(model, opt, loader, TrainConfig(1, log=LogConfig(progress=False),
                                        checkpoint=CheckpointConfig(dir=tmp_path)),
        callbacks=[Recorder()])

    class Quiet:
        def on_step_end(self, step: int, record: dict) -> None:
            pass

    model, opt, loader = _setup()
    result = fit(model, opt, loader, TrainConfig(2, log=LogConfig(progress=False),
                                                 checkpoint=CheckpointConfig(dir=tmp_path,
                                                                             resume="auto")),
                 callbacks=[Quiet(), Recorder()], on_step=lambda s, r: None)
    assert result.steps == 8
