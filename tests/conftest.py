"""Suite-wide setup. This folder is on sys.path, so tests share tests/processes.py; and the test
selection of `make test-compat`: which tests run on every supported torch.

The tests listed in ``TORCH_COMPAT`` are the ones that exercise how ember attaches to torch (its
private hooks, its patched functions, behaviour compared against torch's own), so they are the ones
that can break when torch changes. They get the ``torch_compat`` marker here, in this one place;
``make test-compat`` runs ``pytest -m torch_compat`` on the oldest and newest torch.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Patterns over "<path relative to tests/>::<test name>" (fnmatch: * also matches "/" and "::").
TORCH_COMPAT = (
    # csprng: torch semantics, the adapter and its fail-closed hooks, routing, compile, Opacus,
    # the torchcsprng compatibility module
    "csprng/test_torch_semantics.py::*",
    "csprng/test_torch_adapter.py::*",
    "csprng/test_fail_closed.py::*",
    "csprng/test_routed_paths.py::*",
    "csprng/test_triton_routing.py::*",
    "csprng/test_compile.py::*",
    "csprng/test_opacus.py::*",
    "csprng/test_compat.py::*",
    "csprng/test_capture_refusal.py::*",
    "csprng/test_normal_foreach_cpu.py::*",
    "csprng/test_vmap.py::*",
    "csprng/test_views.py::*",
    "csprng/test_patch.py::*",
    "csprng/test_torch_sweep.py::*",
    # swa: AveragedModel as a drop-in for torch.optim.swa_utils
    "swa/test_averaged_model_dropin.py::*",
    # train: privacy (Opacus), mixed precision, resume
    "train/test_privacy.py::*",
    "train/test_privacy_noise.py::*",
    "train/test_privacy_guards.py::*",
    "train/test_budget_stop.py::*",
    "train/test_precision.py::*",
    "train/test_train_resume.py::*",
)


# Long cases that `make test` leaves to `make test-slow` (pyproject's addopts deselect `slow`), so the
# main suite stays under ten minutes on a 2-core machine: the Triton interpreter's ChaCha20 cases
# (its AES-128 cases, and both ciphers' streams bit for bit on CPU, stay in `make test`), the
# compile-everything NVRTC check (one kernel's compile stays), an experiment and a benchmark run as
# tests, and some multi-process spawns.
SLOW = (
    "csprng/test_triton_kernels.py::*chacha20*",
    "csprng/test_triton_refill.py::*chacha20*",
    "csprng/test_nvrtc.py::test_every_fast_path_kernel_compiles_for_sm90",
    "swa/test_digits.py::test_digits_swa_swag_no_loss_against_tuned_annealed_sgd",
    "swa/test_swap.py::test_bench_experiment_quick_one_seed*",
    # multi-process spawns whose guarantee another test of the main suite also holds: 2-rank DDP
    # training, DP-SGD and ember train's SWAP under torchrun stay in make test
    "swa/test_ddp_averaging.py::*",
    "swa/test_external_writes.py::test_broadcast_bf16_ema_stays_in_sync",
    "train/test_ddp.py::test_two_process_ddp_killed_and_resumed_is_bit_identical",
    # the interpreter's normal kernel over every group shape: float32 stays in make test
    "csprng/test_triton_kernels.py::test_normal_one_kernel_every_group_shape*float16*",
    "csprng/test_triton_kernels.py::test_normal_one_kernel_every_group_shape*float64*",
)


def _test_id(item: pytest.Item) -> str:
    """The item's id with its path relative to tests/ (independent of pytest's rootdir)."""
    path = Path(str(item.path)).resolve()
    try:
        relative = path.relative_to(TESTS).as_posix()
    except ValueError:
        return item.nodeid
    _, sep, rest = item.nodeid.partition("::")
    return relative + sep + rest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        test_id = _test_id(item)
        if any(fnmatchcase(test_id, pattern) for pattern in TORCH_COMPAT):
            item.add_marker(pytest.mark.torch_compat)
        if any(fnmatchcase(test_id, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)
