"""Mixed-precision policy for the training loop, on top of ``torch.amp``.

``fp32`` runs without autocast; ``bf16`` autocasts to bfloat16 and needs no loss scaling (its
exponent range is fp32's); ``fp16`` autocasts to float16 and scales the loss with
``torch.amp.GradScaler`` so small gradients do not flush to zero, skipping steps whose gradients
overflow.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ember.train.errors import ConfigError

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """How forward passes are cast and whether the loss is scaled, for one device type."""

    name: str
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.name!r}; expected one of {', '.join(PRECISIONS)}")
        if self.name != "fp32" and not torch.amp.is_autocast_available(self.device_type):
            raise ConfigError(f"precision {self.name!r} needs torch.autocast on device type "
                              f"{self.device_type!r}, which this torch build does not support")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes in (float32 for ``fp32``)."""
        return _DTYPES[self.name]

    @property
    def uses_scaler(self) -> bool:
        """Whether the loss must be scaled (only ``fp16``)."""
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """A context manager for forward passes (a no-op for ``fp32``)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def make_scaler(self, init_scale: float = 2.0**16) -> torch.amp.GradScaler | None:
        """A GradScaler for ``fp16``, else None."""
        if not self.uses_scaler:
            return None
        try:
            return torch.amp.GradScaler(self.device_type, init_scale=init_scale)
        except (RuntimeError, ValueError) as exc:  # pragma: no cover - depends on the torch build
            raise ConfigError(f"precision 'fp16' needs torch.amp.GradScaler on {self.device_type!r}: "
                              f"{exc}; use precision='bf16'") from exc
