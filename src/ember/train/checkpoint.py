"""Training checkpoints: one file holding everything a run needs to continue bit for bit.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, loaded with
``torch.load(weights_only=True)`` so that opening one never runs pickled code. It is written to a
temporary file in the same directory and renamed, so a run killed while saving leaves the previous
checkpoint intact.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.train.errors import ConfigError

__all__ = ["CHECKPOINT_NAME", "FORMAT", "find_checkpoint", "load_checkpoint", "rng_state",
           "save_checkpoint", "set_rng_state", "weights_digest"]

FORMAT = "ember-train-checkpoint/2"
_EARLIER_FORMATS = ("ember-train-checkpoint/1",)
CHECKPOINT_NAME = "last.pt"


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], *,
                    owner_only: bool = False) -> Path:
    """Write ``state`` to ``path`` atomically; returns the path.

    ``owner_only`` (for secrets such as a DP run's noise key): the file is created readable and
    writable by its owner only (0600 on POSIX; Windows keeps its default access) and a directory
    created for it is 0700.
    """
    path = Path(path)
    if owner_only:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".writing")
    if owner_only:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0),
                     0o600)
        try:
            if hasattr(os, "fchmod"):  # a stale .writing file would keep its wider mode
                os.fchmod(fd, 0o600)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
    else:
        torch.save({"format": FORMAT, **state}, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (tensors on CPU)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types for a file that is not its format
        first = str(exc).strip().split(". ")[0].splitlines()[0] if str(exc).strip() \
            else type(exc).__name__
        raise ConfigError(f"{path} is not an ember.train checkpoint (torch.load: "
                          f"{first[:200]})") from None
    if isinstance(state, dict) and state.get("format") in _EARLIER_FORMATS:
        raise ConfigError(f"{path} was written by an earlier ember (format {state['format']!r}, "
                          f"this one reads {FORMAT!r}): finish that run with the version that "
                          "wrote it, or start a new one")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{path} is not an ember.train checkpoint (expected format {FORMAT!r})")
    return state


def find_checkpoint(resume: str | os.PathLike | None, checkpoint_dir: str | os.PathLike | None
                    ) -> Path | None:
    """The checkpoint to resume from: ``resume`` itself, or with ``resume="auto"`` the last
    checkpoint in ``checkpoint_dir`` if there is one."""
    if resume is None:
        return None
    if str(resume) == "auto":
        if checkpoint_dir is None:
            raise ConfigError("resume='auto' needs checkpoint_dir")
        candidate = Path(checkpoint_dir) / CHECKPOINT_NAME
        return candidate if candidate.is_file() else None
    path = Path(resume)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise ConfigError(f"resume: no checkpoint at {path}")
    return path


def rng_state() -> dict[str, Any]:
    """torch's global CPU generator state (dropout and friends draw from it)."""
    return {"torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of a model's state dict."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        # reshape first: a 0-dim tensor (BatchNorm's num_batches_tracked) cannot be viewed as bytes
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
