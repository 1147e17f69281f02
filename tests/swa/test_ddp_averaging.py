"""EMA, SWA and SWAG updated from a DistributedDataParallel model with BatchNorm: 2 gloo ranks.

Each rank trains a DDP-wrapped BatchNorm + dropout model for a few steps and updates the averagers
from the wrapper (and, in the second test, from ``torch.compile`` of the wrapper). The result must
equal updates from the unwrapped module, torch's ``AveragedModel`` fed the same wrapper, and be the
same on both ranks.
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(12, 3))


def _worker(rank: int, world: int, init_file: str, out_dir: str, compiled: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        # the DDP wrapper and everything else is freed when _train returns, before the group is
        # destroyed: a DDP object outliving its gloo group now and then hung a rank at exit
        _train(rank, world, out_dir, compiled)
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, out_dir: str, compiled: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from ember.swa import EMA, SWA, SWAG

    base = _model()
    ddp = DDP(base)
    net = torch.compile(ddp, backend="eager") if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ema, swa, swag = EMA(base, 0.7, warmup=False), SWA(base), SWAG(base, max_rank=3)
    ema_ref, swa_ref, swag_ref = EMA(base, 0.7, warmup=False), SWA(base), SWAG(base, max_rank=3)
    torch_ema = AveragedModel(base, multi_avg_fn=get_ema_multi_avg_fn(0.7), use_buffers=True)
    torch_swa = AveragedModel(base)
    # ember's EMA starts from the weights it was built from; AveragedModel's first update copies
    torch_ema.update_parameters(ddp)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    torch.manual_seed(rank)
    for _ in range(4):
        x = torch.randn(8, 6, generator=g)
        y = (x[:, 0] > 0).long()
        loss = nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update(net)
        swa.update(net)
        swag.collect(net)
        ema_ref.update(base)
        swa_ref.update(base)
        swag_ref.collect(base)
        torch_ema.update_parameters(ddp)
        torch_swa.update_parameters(ddp)
    flat = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    torch.save({
        "ema": ema.module.state_dict(), "ema_ref": ema_ref.module.state_dict(),
        "torch_ema": {k.removeprefix("module."): v for k, v in torch_ema.state_dict().items()
                      if k != "n_averaged"},
        "swa": swa.module.state_dict(), "swa_ref": swa_ref.module.state_dict(),
        "torch_swa": {k.removeprefix("module."): v for k, v in torch_swa.state_dict().items()
                      if k != "n_averaged"},
        "swag": swag.state_dict(), "swag_ref": swag_ref.state_dict(),
        "gathered": gathered,
    }, os.path.join(out_dir, f"rank{rank}.pt"))


# one 2-rank run takes seconds; a run past this is hung (once in a full-suite run, 2026-12-06, a
# rank sat idle on its gloo socket for 17 minutes before writing its result)
DEADLINE_S = 180.0


def _spawn(args: tuple, nprocs: int) -> None:
    """``mp.spawn(..., join=True)`` with a deadline: hung ranks are killed and reported as a
    :class:`TimeoutError` instead of holding the test suite."""
    import time

    ctx = mp.spawn(_worker, args=args, nprocs=nprocs, join=False)
    stop = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1.0):
        if time.monotonic() > stop:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join()
            raise TimeoutError(f"the {nprocs}-rank run did not finish in {DEADLINE_S:.0f} s")


def _run(tmp_path, compiled: bool) -> list[dict]:
    for attempt in range(2):
        init_file = str(tmp_path / f"init{attempt}").replace("\\", "/")
        try:
            _spawn((2, init_file, str(tmp_path), compiled), nprocs=2)
            break
        except TimeoutError as err:  # a hung run is retried once, as a rank killed by a signal
            if attempt:
                raise
            warnings.warn(f"retrying the 2-rank run: {err}", stacklevel=1)
        except mp.ProcessExitedException as err:
            # once in a full-suite run (2026-12-05) rank 0 of the compiled case died with SIGABRT
            # ("terminate called without an active exception") inside torch while dynamo traced
            # the DDP forward; not reproduced in 14 reruns, 10 of them under load. A rank killed
            # by a signal is retried once; a Python error or a failed assertion in a rank is not
            # (ProcessRaisedException)
            if attempt or err.signal_name is None:
                raise
            warnings.warn(f"retrying the 2-rank run: {err}", stacklevel=1)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def _check(results: list[dict]) -> None:
    for r, res in enumerate(results):
        # DDP keeps the ranks' weights in sync: the averagers saw the same weights everywhere
        assert torch.equal(res["gathered"][0], res["gathered"][1])
        for key in ("ema", "swa"):
            mine, ref = res[key], res[f"{key}_ref"]
            assert mine.keys() == ref.keys()
            for name in mine:
                assert torch.equal(mine[name], ref[name]), (r, key, name)
        # torch's AveragedModel fed the DDP wrapper: parameters agree (EMA with buffers too)
        for name, value in res["torch_ema"].items():
            if name.endswith("num_batches_tracked"):
                continue  # an integer counter: ember copies it, AveragedModel does not average it
            torch.testing.assert_close(res["ema"][name], value, rtol=1e-6, atol=1e-7)
        for name, value in res["torch_swa"].items():
            if "running" in name or "num_batches" in name:
                continue  # AveragedModel keeps its own copy of buffers unless use_buffers
            torch.testing.assert_close(res["swa"][name], value, rtol=1e-6, atol=1e-7)
        # BatchNorm statistics reached the averagers (not the construction-time zeros)
        assert not torch.equal(res["ema"]["1.running_mean"], torch.zeros(12))
        for k, v in res["swag"].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, res["swag_ref"][k]), k
        assert res["swag"]["n_collected"] == 4
    # parameters agree across ranks (BatchNorm buffers need not: DDP broadcasts rank 0's before
    # each forward, then every rank updates them from its own batch)
    for key in ("ema", "swa"):
        for name in results[0][key]:
            if "running" not in name and "num_batches" not in name:
                assert torch.equal(results[0][key][name], results[1][key][name]), (key, name)


def test_ema_swa_swag_update_from_a_ddp_wrapped_batchnorm_model(tmp_path):
    _check(_run(tmp_path, compiled=False))


@pytest.mark.skipif(sys.platform == "win32", reason="torch.compile is not supported on Windows")
def test_ema_swa_swag_update_from_a_compiled_ddp_model(tmp_path):
    # backend="eager": the wrapper structure (_orig_mod.module.) is what is under test; inductor's
    # C++ compilation would take minutes on the 2-core CI machine
    _check(_run(tmp_path, compiled=True))
