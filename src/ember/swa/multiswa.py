"""Multi-SWA (Wilson & Izmailov, 2020): an ensemble of independently trained SWA solutions,
predicting the average of the members' class probabilities.

This module owns the ensemble (:class:`MultiSWA`); training its members is
:func:`ember.train.recipes.train_multiswa`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ember.swa._batches import unwrapped_names
from ember.swa.bn import update_bn

__all__ = ["MultiSWA"]


def _signature(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    strip = unwrapped_names(model)
    return [(strip(k), tuple(v.shape)) for k, v in model.state_dict().items()]


class MultiSWA:
    """Ensemble predictor over SWA models of one architecture.

    ``members`` are ``nn.Module``\\ s returning logits (e.g. ``TrainResult.swa.module``).
    Calling the ensemble on inputs returns the mean of the members' softmax probabilities, each
    member in eval mode. Recompute the members' BatchNorm statistics with :meth:`update_bn_`
    (or pass ``bn_loader`` to :meth:`predict`) after averaging their weights.
    """

    def __init__(self, members: Sequence[nn.Module]) -> None:
        members = list(members)
        if len(members) < 1:
            raise ValueError("MultiSWA needs at least one member")
        first = _signature(members[0])
        for i, m in enumerate(members[1:], start=1):
            if _signature(m) != first:
                raise ValueError(
                    f"member {i} does not match member 0's architecture (state_dict keys or "
                    f"shapes differ)")
        self.members = members

    def __len__(self) -> int:
        return len(self.members)

    def update_bn_(self, loader: Iterable[Any], *, max_batches: int | None = None) -> None:
        """Recompute every member's BatchNorm statistics on ``loader`` (training data)."""
        for m in self.members:
            update_bn(loader, m, max_batches=max_batches)

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        """Mean of the members' softmax probabilities on the input batch ``x``."""
        total: Tensor | None = None
        for m in self.members:
            was = m.training
            m.eval()
            try:
                p = torch.softmax(m(x).float(), dim=-1)
            finally:
                m.train(was)
            total = p if total is None else total + p
        assert total is not None
        return total / len(self.members)

    def predict(self, loader: Iterable[Any], *, bn_loader: Iterable[Any] | None = None,
                bn_max_batches: int | None = None) -> Tensor:
        """Ensemble probabilities over ``loader`` (batches of inputs or ``(inputs, targets)``);
        with ``bn_loader`` the members' BatchNorm statistics are recomputed first."""
        if bn_loader is not None:
            self.update_bn_(bn_loader, max_batches=bn_max_batches)
        out = [self(b[0] if isinstance(b, (tuple, list)) else b) for b in loader]
        if not out:
            raise ValueError("MultiSWA.predict: the loader yielded no batches")
        return torch.cat(out)

    def state_dict(self) -> dict[str, Any]:
        """The members' state dicts."""
        return {"members": [m.state_dict() for m in self.members]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (same number of members)."""
        if len(state["members"]) != len(self.members):
            raise ValueError(f"state holds {len(state['members'])} members, this ensemble "
                             f"{len(self.members)}")
        for m, s in zip(self.members, state["members"], strict=True):
            m.load_state_dict(s)


_MOVED = ("train_multiswa",)  # moved to ember.train.recipes; the old name warns until ember 0.2


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        from ember.train.recipes import multiswa as _recipes_multiswa  # deprecation shim

        warnings.warn("ember.swa.multiswa.train_multiswa has moved to "
                      "ember.train.recipes.multiswa.train_multiswa; the old path will be removed "
                      "in ember 0.2", DeprecationWarning, stacklevel=2)
        return _recipes_multiswa.train_multiswa
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # the moved names stay discoverable (help(), completion); `from ... import *` skips them, since
    # star imports read __all__, which may not name them without importing ember.train
    return sorted(set(globals()) | set(_MOVED))
