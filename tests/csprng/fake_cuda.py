"""Test helper (not a test module): CPU tensors that report a CUDA device, so the CUDA routes run
their host logic on a machine without a GPU."""

from __future__ import annotations

import torch


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the CUDA routes run their host logic on it."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_cpu(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def cuda(t: torch.Tensor) -> OnCuda:
    """``t`` viewed as an :class:`OnCuda` tensor (same storage)."""
    return t.as_subclass(OnCuda)
