"""Empty Poisson batches are normal in DP-SGD: the loss function is never asked for the mean of
nothing, the step is reported as empty (no NaN), and the run goes on."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")

from ember.train import TrainConfig, fit  # noqa: E402
from ember.train.privacy import PrivacyConfig  # noqa: E402


def _strict_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.cross_entropy(logits, target)
    if not torch.isfinite(loss):  # a user's divergence check, as ember train's
        raise AssertionError("non-finite loss")
    return loss


def test_empty_poisson_batches_are_reported_as_empty_steps(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, generator=g),
                                          torch.randint(0, 2, (8,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=1)  # q = 1/8: ~34% of batches empty
    privacy = PrivacyConfig(noise_multiplier=1.0, delta=1e-3, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                     TrainConfig(epochs=6, metrics_path=tmp_path / "m.jsonl", progress=False),
                     loss_fn=_strict_loss, privacy=privacy)
    steps = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["event"] == "step"]
    empty = [r for r in steps if r.get("empty")]
    assert len(steps) == result.steps == 48 and result.privacy["steps"] == 48
    assert 0 < len(empty) == result.empty_steps < 48
    assert all(r["loss"] is None for r in empty)
    assert all(isinstance(r["loss"], float) for r in steps if not r.get("empty"))
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 2))
        g = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(8, 3, generator=g),
                                              torch.randint(0, 2, (8,), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=1)  # each rank: 4 examples, q 1/8
        privacy = PrivacyConfig(noise_multiplier=1.0, delta=1e-3, max_grad_norm=1.0,
                                noise_seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fit(model, torch.optim.SGD(model.parameters(), lr=0.1), loader,
                         TrainConfig(epochs=4, progress=False), loss_fn=_strict_loss,
                         privacy=privacy)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"steps": result.steps, "empty": result.empty_steps,
                       "digests": result.rank_digests}, f)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available()
                    or not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_under_two_ranks_an_empty_batch_on_one_rank_leaves_no_rank_waiting(tmp_path):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = torch.multiprocessing.spawn(_rank, args=(port, str(tmp_path)), nprocs=2,
                                          join=False)
    deadline = time.monotonic() + 600  # generous for a loaded machine; a hang never ends
    while not context.join(timeout=5):
        assert time.monotonic() < deadline, "a rank is still waiting after 600 s"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 32
    assert ranks[0]["empty"] > 0 or ranks[1]["empty"] > 0
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(set(ranks[0]["digests"])) == 1
