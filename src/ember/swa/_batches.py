"""Shared helpers: moving batches to a device, calling a model on a batch, compile prefixes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

Forward = Callable[[nn.Module, Any], Any]


def to_device(batch: Any, device: torch.device | str | int | None) -> Any:
    """Return ``batch`` with every tensor in it (tuples, lists, dicts, nested) on ``device``."""
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def default_forward(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a tensor, on a tuple/list's first element, or on a dict as keywords."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        if len(batch) == 0:
            raise ValueError("got an empty tuple/list batch; pass forward= to call the model")
        return model(batch[0])
    raise TypeError(
        f"cannot call the model on a batch of type {type(batch).__name__}; expected a tensor, "
        "a tuple/list whose first element is the input, or a dict of keyword arguments "
        "(or pass forward=callable(model, batch))"
    )


def strip_compile_prefix(name: str) -> str:
    """Return a parameter/buffer name without wrapper prefixes.

    Removes every ``_orig_mod.`` part (``torch.compile``, also of a submodule) and the leading
    ``module.`` parts of ``DistributedDataParallel``/``DataParallel``, nested in any order
    (``module._orig_mod.x``, ``_orig_mod.module.x``).
    """
    parts = [part for part in name.split(".") if part != "_orig_mod"]
    while len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _is_data_parallel(model: nn.Module) -> bool:
    return isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """Return the module inside ``torch.compile``/DDP/``DataParallel`` wrappers, nested."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif _is_data_parallel(model):
            model = model.module
        else:
            return model
