import pytest
import torch
from torch import nn

from ember.swa.multiswa import MultiSWA
from ember.train.recipes import train_multiswa


def _mlp(hidden=8):
    return nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(hidden, 3))


def test_predicts_mean_of_member_probabilities_in_eval_mode():
    torch.manual_seed(0)
    members = [_mlp() for _ in range(3)]
    x = torch.randn(10, 4)
    ens = MultiSWA(members)
    for m in members:
        m.train()
    probs = ens(x)
    expected = []
    for m in members:
        m.eval()
        with torch.no_grad():
            expected.append(torch.softmax(m(x), -1))
        m.train()
    torch.testing.assert_close(probs, torch.stack(expected).mean(0))
    assert all(m.training for m in members)  # modes restored
    loader = [(x[:5], None), (x[5:], None)]
    torch.testing.assert_close(ens.predict(loader), probs)


def test_mismatched_members_and_state_dict():
    with pytest.raises(ValueError, match="member 1"):
        MultiSWA([_mlp(8), _mlp(9)])
    # a torch.compile'd member of the same architecture is accepted
    assert len(MultiSWA([_mlp(8), torch.compile(_mlp(8))])) == 2
    with pytest.raises(ValueError, match="at least one"):
        MultiSWA([])
    torch.manual_seed(0)
    a = MultiSWA([_mlp(), _mlp()])
    b = MultiSWA([_mlp(), _mlp()])
    x = torch.randn(6, 4)
    assert not torch.allclose(a(x), b(x))
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(x), b(x))
    with pytest.raises(ValueError, match="members"):
        MultiSWA([_mlp()]).load_state_dict(a.state_dict())


def test_update_bn_recomputes_each_member():
    torch.manual_seed(0)
    ens = MultiSWA([_mlp(), _mlp()])
    data = [torch.randn(16, 4) * 3 + 1 for _ in range(2)]
    ens.update_bn_(data)
    for m in ens.members:
        with torch.no_grad():
            h = m[0](torch.cat(data))
        torch.testing.assert_close(m[1].running_mean, h.mean(0), atol=1e-5, rtol=1e-5)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return x, y


def test_train_multiswa_through_fit():
    from ember.train import TrainConfig

    x, y = _data()

    def loader(seed):
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(96, generator=g)
        return [(x[perm[i:i + 32]], y[perm[i:i + 32]]) for i in range(0, 96, 32)]

    bn = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 96, 32)]
    config = TrainConfig(epochs=4, swa_start=2, swa_lr=0.05, progress=False)
    ens = train_multiswa(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loader,
                         config, [0, 1], bn_loader=bn)
    assert len(ens) == 2
    w0, w1 = (torch.cat([p.reshape(-1) for p in m.parameters()]) for m in ens.members)
    assert not torch.allclose(w0, w1)  # different seeds, different members
    probs = ens(x)
    assert probs.shape == (96, 3)
    torch.testing.assert_close(probs.sum(1), torch.ones(96))
    with pytest.raises(ValueError, match="swa_start"):
        train_multiswa(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loader,
                       TrainConfig(epochs=2, progress=False), [0], bn_loader=bn)
    with pytest.raises(ValueError, match="bn_loader"):
        train_multiswa(_mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loader,
                       config, [0])


def test_bench_experiment_quick_structure():
    import importlib.util
    import math
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "swa_family_multiswa.py"
    spec = importlib.util.spec_from_file_location("swa_family_multiswa", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert "Deep ensemble" in mod.PROTOCOL
    rows = mod.experiment(quick=True, seeds=[0])
    assert {r["method"] for r in rows} == {"Deep ensemble", "Multi-SWA", "MultiSWAG"}
    assert {r["test_set"] for r in rows} == {"clean", "pixel noise", "rotation"}
    for r in rows:
        assert r["experiment"] == "multiswa" and r["n_seeds"] == 1
        for k in ("accuracy", "nll", "ece", "wall_s"):
            assert math.isfinite(r[f"{k}_mean"]) and r[f"{k}_std"] == 0.0
        assert 0.0 <= r["accuracy_mean"] <= 1.0 and r["nll_mean"] > 0


def test_harness_runs_present_and_skips_missing(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "swa_family.py"
    spec = importlib.util.spec_from_file_location("swa_family", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # a missing module is skipped with a note, not a crash
    mod.HERE = tmp_path
    (tmp_path / "swa_family_swap.py").write_text("raise ImportError('broken on purpose')\n")
    doc = mod.run(quick=True, seeds=[0], only=["swap", "fastswa"], out=tmp_path / "o.json")
    assert set(doc["skipped"]) == {"swap", "fastswa"} and doc["rows"] == []
    assert "broken on purpose" in doc["skipped"]["swap"]
    assert json.loads((tmp_path / "o.json").read_text())["skipped"] == doc["skipped"]
    assert "skipping fastswa" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown"):
        mod.run(quick=True, seeds=[0], only=["nope"], out=None)
    rows = [{"experiment": "e", "method": "m", "test_set": "clean", "accuracy_mean": 0.5,
             "accuracy_std": 0.1, "n_seeds": 3}]
    table = mod.format_table(rows)
    assert "0.500±0.100" in table and "e" in table.splitlines()[2]
