"""Shared helpers: moving batches to a device, calling a model on a batch, wrapper prefixes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, cast

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
        return cast(Any, type(batch))({k: to_device(v, device) for k, v in batch.items()})
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


def wrapped_child(module: nn.Module) -> str | None:
    """The name of the child that the wrapper ``module`` wraps, ``None`` if it wraps nothing.

    ``torch.compile``'s ``OptimizedModule`` holds the module as ``_orig_mod``,
    ``DistributedDataParallel``/``DataParallel`` hold it as ``module``; all are recognised by type
    only, since a plain model may well have a child called ``module`` or ``_orig_mod``.
    """
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    if compiled is not None and isinstance(module, compiled.OptimizedModule):
        return "_orig_mod"
    if _is_data_parallel(module):
        return "module"
    return None


def unwrapped_names(model: nn.Module) -> Callable[[str], str]:
    """Return a function that maps a name of ``model`` (from ``named_parameters()``,
    ``named_buffers()`` or ``state_dict()``) to the name without the wrappers' parts.

    Only the parts that are a wrapper's are removed: the ``module.`` of each
    ``DistributedDataParallel``/``DataParallel`` and the ``_orig_mod.`` of each ``torch.compile``
    wrapper in the module tree (around the model, nested in any order, or around a submodule).
    A child that the model itself calls ``module`` keeps its name.
    """
    parts = set()
    for path, module in model.named_modules(remove_duplicate=False):
        child = wrapped_child(module)
        if child is not None:
            parts.add(f"{path}.{child}" if path else child)
    if not parts:
        return lambda name: name

    def strip(name: str) -> str:
        kept = []
        path = ""
        for part in name.split("."):
            path = f"{path}.{part}" if path else part
            if path not in parts:
                kept.append(part)
        return ".".join(kept)

    return strip


def unwrapped_named_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` with the names of :func:`unwrapped_names`."""
    strip = unwrapped_names(model)
    return [(strip(n), p) for n, p in model.named_parameters()]


def _is_data_parallel(model: nn.Module) -> bool:
    return isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel))


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """Return the module inside ``torch.compile``/DDP/``DataParallel`` wrappers, nested."""
    while True:
        child = wrapped_child(model)
        if child is None:
            return model
        model = getattr(model, child)
