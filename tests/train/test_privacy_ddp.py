"""DP-SGD under DDP: 2 gloo ranks (torch.multiprocessing spawn) spend what one process spends."""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

N, BATCH, EPOCHS = 96, 16, 2


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g),
                                          torch.randint(0, 3, (N,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loader


def _privacy(physical):
    from ember.train import PrivacyConfig

    return PrivacyConfig(noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, noise_seed=7,
                         max_physical_batch_size=physical)


def _train(physical, ema: bool = False):
    from ember.train import TrainConfig, fit

    model, opt, loader = _setup()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
        torch.manual_seed(1)  # another initial model on rank 1: fit must start from rank 0's
        for p in model.parameters():
            p.data.normal_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit(model, opt, loader, TrainConfig(epochs=EPOCHS, progress=False,
                                                   ema_decay=0.9 if ema else None),
                   privacy=_privacy(physical))


def _watch_noise_and_streams(patch=setattr):
    """Count the DP noise draws and record a digest of each sampler's generator state (patched
    into ember.train.privacy with ``patch``, e.g. monkeypatch.setattr; returns the record the
    patches fill)."""
    import hashlib

    from ember.train import privacy

    seen = {"noise_calls": 0, "streams": []}
    add_noise, batches_init = privacy.add_secure_noise, privacy._PoissonBatches.__init__

    def counting_noise(tensors, std, generator):
        seen["noise_calls"] += 1
        return add_noise(tensors, std, generator)

    def recording_init(self, share, sample_rate, steps, generator, *args, **kwargs):
        state = generator.get_state().numpy().tobytes()
        seen["streams"].append(hashlib.sha256(state).hexdigest())
        batches_init(self, share, sample_rate, steps, generator, *args, **kwargs)

    patch(privacy, "add_secure_noise", counting_noise)
    patch(privacy._PoissonBatches, "__init__", recording_init)
    return seen


def _worker(rank: int, port: int, out: str, physical) -> None:
    from ember.train import weights_digest

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=2)
    try:
        seen = _watch_noise_and_streams()
        result = _train(physical, ema=True)
        ema = [None, None]
        torch.distributed.all_gather_object(ema, weights_digest(result.ema.module))
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "digests": result.rank_digests, "ema": ema, "epsilon": result.epsilon,
            "steps": result.steps, "report": result.privacy,
            "history": [r["epsilon"] for r in result.history], **seen}))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("physical", [5])  # physical batches: ranks split differently
def test_two_ranks_spend_the_single_process_epsilon_and_stay_in_sync(tmp_path, physical,
                                                                     monkeypatch):
    from opacus.accountants import RDPAccountant

    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(tmp_path), physical), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    seen = _watch_noise_and_streams(monkeypatch.setattr)
    single = _train(physical)
    acc = RDPAccountant()
    acc.history = [(1.0, 1 / (N // BATCH), EPOCHS * (N // BATCH))]
    for r in ranks:
        assert r["steps"] == single.steps == EPOCHS * (N // BATCH)
        assert r["epsilon"] == single.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
        assert r["history"] == [h["epsilon"] for h in single.history]
        assert r["report"]["world_size"] == 2 and r["report"]["sample_rate"] == 1 / (N // BATCH)
    assert ranks[0]["digests"] == ranks[1]["digests"] and len(set(ranks[0]["digests"])) == 1
    assert len(set(ranks[0]["ema"])) == 1
    # the noise is added once per logical step, by rank 0 only (DistributedDPOptimizer)
    assert seen["noise_calls"] == single.steps
    assert ranks[0]["noise_calls"] == single.steps and ranks[1]["noise_calls"] == 0
    # each rank samples from its own stream; rank 0's is the one process's
    assert len(ranks[0]["streams"]) == len(ranks[1]["streams"]) == len(seen["streams"]) == 1
    assert ranks[0]["streams"] == seen["streams"] != ranks[1]["streams"]
