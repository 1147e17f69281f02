"""SWA-Gaussian posteriors (SWAG, MultiSWAG) and Bayesian model averaging over their samples.

Follows Maddox et al. (2019): running first and second moments of the flattened parameters, a ring
of the last ``K`` deviations from the running mean, and samples
``mean + sqrt(scale) * (sqrt(var) * z1 + D^T z2 / sqrt(K' - 1))``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ember.swa._batches import Forward, default_forward, to_device, unwrapped_named_parameters
from ember.swa.bn import has_running_stats, update_bn

__all__ = ["SWAG", "MultiSWAG", "bayesian_average"]



def _select_params(params_all: list[tuple[str, Tensor]],
                   params: Sequence[str] | Callable[[str, Tensor], bool] | None,
                   ) -> list[tuple[str, Tensor]]:
    """The (name, parameter) pairs ``params`` selects from ``params_all``, in model order."""
    if params is None:
        return params_all
    if callable(params):
        selected = [(n, p) for n, p in params_all if params(n, p)]
        if not selected:
            raise ValueError("the params predicate selected no parameter of the model")
        return selected
    if isinstance(params, str):
        raise ValueError("params must be a sequence of names or a predicate, not one "
                         f"string: pass [{params!r}]")
    wanted = list(params)
    by_name = dict(params_all)
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise ValueError(f"params names not among the model's parameters: {unknown[:5]}")
    if len(set(wanted)) != len(wanted):
        raise ValueError("params lists a parameter name more than once")
    if not wanted:
        raise ValueError("params is empty: select at least one parameter")
    chosen = set(wanted)
    return [(n, p) for n, p in params_all if n in chosen]

class SWAG:
    """A SWAG posterior over the parameters of models shaped like ``model``.

    Call :meth:`collect` with the training model at each collection point of the SWA phase, then
    :meth:`sample`. Statistics are stored flat on ``device`` (default: the model's) in ``dtype``
    (default float32) and take ``(2 + max_rank) * P`` elements for ``P`` parameters. Buffers are not
    part of the posterior: recompute BatchNorm statistics for each sample (see
    :func:`bayesian_average`).

    ``diagonal=True`` keeps no deviation ring (SWAG-Diagonal, ``2 * P`` elements; ``max_rank`` is
    ignored and 0 is allowed); every sample is then diagonal. ``params`` restricts the posterior to
    a subset of the parameters: a sequence of parameter names (as in ``named_parameters()``, without
    ``module.``/``_orig_mod.`` prefixes) or a predicate ``(name, parameter) -> bool``, e.g. only the
    last layer. :meth:`collect` reads and :meth:`sample`/:meth:`load_into` write only that subset;
    the other parameters of the model are left as they are.
    """

    def __init__(
        self,
        model: nn.Module,
        max_rank: int = 20,
        *,
        diagonal: bool = False,
        params: Sequence[str] | Callable[[str, Tensor], bool] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        var_clamp: float = 1e-30,
    ) -> None:
        if not isinstance(diagonal, bool):
            raise ValueError(f"diagonal must be a bool, got {diagonal!r}")
        if diagonal:
            if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 0:
                raise ValueError(f"max_rank must be an integer >= 0, got {max_rank!r}")
            max_rank = 0
        elif isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ValueError(f"max_rank must be an integer >= 1 (or pass diagonal=True), "
                             f"got {max_rank!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        params_all = unwrapped_named_parameters(model)
        if not params_all:
            raise ValueError("model has no parameters to build a SWAG posterior over")
        self.subset = params is not None
        selected = _select_params(params_all, params)
        self.diagonal = diagonal
        if device is None:
            device = selected[0][1].device
        self.names = [n for n, _ in selected]
        self.shapes = [tuple(p.shape) for _, p in selected]
        self.numels = [p.numel() for _, p in selected]
        self.num_parameters = sum(self.numels)
        self.max_rank = max_rank
        self.var_clamp = var_clamp
        self.device = torch.device(device)
        self.dtype = dtype
        p_count = self.num_parameters
        self.mean = torch.zeros(p_count, device=self.device, dtype=dtype)
        # Welford: the population variance itself is kept, not the second moment, so that weights
        # around 1 with a small spread keep their variance in float32 (sq_mean - mean^2 cancels)
        self.var = torch.zeros(p_count, device=self.device, dtype=dtype)
        self.deviations = torch.zeros(max_rank, p_count, device=self.device, dtype=dtype)
        self.n_collected = 0

    # -- bookkeeping ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Number of deviation rows currently stored (``K'`` = min(collected, max_rank))."""
        return min(self.n_collected, self.max_rank)

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the statistics: ``(2 + max_rank) * P * itemsize``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (2 + self.max_rank) * self.num_parameters * itemsize

    def _check_model(self, model: nn.Module) -> list[Tensor]:
        params = unwrapped_named_parameters(model)
        if self.subset:
            by_name = dict(params)
            missing = [n for n in self.names if n not in by_name]
            if missing:
                raise ValueError("model does not match this SWAG posterior: missing parameters "
                                 f"{missing[:5]}")
            params = [(n, by_name[n]) for n in self.names]
        names = [n for n, _ in params]
        if names != self.names:
            missing = [n for n in self.names if n not in names]
            extra = [n for n in names if n not in self.names]
            raise ValueError(
                "model does not match this SWAG posterior: "
                f"missing parameters {missing[:5]}, unexpected parameters {extra[:5]}"
                + ("" if missing or extra else " (same names in a different order)")
            )
        for (name, p), shape in zip(params, self.shapes, strict=True):
            if tuple(p.shape) != shape:
                raise ValueError(
                    f"model does not match this SWAG posterior: parameter {name!r} has shape "
                    f"{tuple(p.shape)}, expected {shape}"
                )
        return [p for _, p in params]

    # -- collection ----------------------------------------------------------------------------

    def update(self, model: nn.Module, step: int | None = None) -> None:
        """Add the current parameters of ``model`` to the posterior: the averager protocol shared
        with :class:`SWA` and :class:`EMA` (``step`` is accepted and not used: every call
        collects)."""
        self.collect(model)

    @torch.no_grad()
    def collect(self, model: nn.Module) -> None:
        """Add the current parameters of ``model`` to the running moments and the deviation ring
        (the same as :meth:`update`)."""
        params = self._check_model(model)
        n = self.n_collected
        if self.diagonal:
            row = torch.empty(self.num_parameters, device=self.device, dtype=self.dtype)
        else:
            row = self.deviations[n % self.max_rank]
        # the flattened weights go straight into their ring slot, which then becomes the deviation
        offset = 0
        # non_blocking only towards an accelerator (a host destination is read right away)
        non_blocking = self.device.type != "cpu"
        for p, k in zip(params, self.numels, strict=True):
            row[offset : offset + k].copy_(p.detach().reshape(-1), non_blocking=non_blocking)
            offset += k
        self.mean.lerp_(row, 1.0 / (n + 1))
        row.sub_(self.mean)  # w - new mean: the deviation kept in the ring
        if n > 0:
            # Welford: var_{n+1} = n/(n+1) var_n + (w - mean_{n+1})^2 / n
            self.var.mul_(n / (n + 1)).addcmul_(row, row, value=1.0 / n)
        self.n_collected = n + 1

    @property
    def sq_mean(self) -> Tensor:
        """Second moment ``var + mean^2`` (computed; the variance is what is stored)."""
        return torch.addcmul(self.var, self.mean, self.mean)

    def variance(self) -> Tensor:
        """Diagonal variance of the collected weights, clamped below at ``var_clamp``."""
        self._require_collected("variance()")
        return torch.clamp(self.var, min=self.var_clamp)

    def deviation_matrix(self) -> Tensor:
        """The stored deviations ``D`` as a ``(K', P)`` matrix, oldest first."""
        k = self.rank
        if self.n_collected <= self.max_rank or self.diagonal:
            return self.deviations[:k]
        start = self.n_collected % self.max_rank
        return torch.cat([self.deviations[start:], self.deviations[:start]])

    def _require_collected(self, what: str) -> None:
        if self.n_collected == 0:
            raise RuntimeError(f"{what} called before collect(): the SWAG posterior is empty")

    # -- sampling ------------------------------------------------------------------------------

    @torch.no_grad()
    def sample(
        self,
        scale: float = 0.5,
        diag_only: bool = False,
        generator: torch.Generator | None = None,
        *,
        model: nn.Module | None = None,
    ) -> Tensor:
        """Draw one flat weight vector; also load it into ``model`` when given.

        ``scale`` multiplies the covariance (0 gives the SWA mean). ``diag_only`` drops the
        low-rank term (SWAG-Diagonal; the paper uses ``scale=1`` with it). Normals are drawn with
        ``torch.randn(..., generator=generator)`` in the posterior's dtype on the generator's
        device: first ``P`` for the diagonal part, then ``K'`` for the low-rank part (the i-th
        paired with the i-th oldest stored deviation).
        """
        self._require_collected("sample()")
        diag_only = diag_only or self.diagonal
        if not scale >= 0:
            raise ValueError(f"scale must be >= 0, got {scale}")
        if not diag_only and self.rank < 2:
            raise ValueError(
                "the low-rank term needs at least 2 collected models, got "
                f"{self.n_collected}; collect more or pass diag_only=True"
            )
        if model is not None:
            self._check_model(model)
        draw_device = self.device if generator is None else generator.device
        z1 = torch.randn(
            self.num_parameters, generator=generator, device=draw_device, dtype=self.dtype
        ).to(self.device)
        # theta is built in place in one buffer: a 25 M-parameter model makes every temporary
        # a 100 MB allocation
        theta = self.var.clone()
        theta.clamp_(min=self.var_clamp).sqrt_().mul_(z1)
        del z1
        if not diag_only:
            k = self.rank
            z2 = torch.randn(k, generator=generator, device=draw_device, dtype=self.dtype)
            z2 = z2.to(self.device) / (k - 1) ** 0.5
            # z2[i] pairs with the i-th oldest stored deviation; reorder it to the ring's rows
            # rather than copying the (K, P) ring into chronological order
            start = self.n_collected % self.max_rank if self.n_collected > self.max_rank else 0
            ring_order = (torch.arange(k, device=self.device) - start) % k
            theta.addmv_(self.deviations[:k].t(), z2[ring_order])
        theta.mul_(scale**0.5).add_(self.mean)
        if model is not None:
            self.load_into(model, theta)
        return theta

    def mean_vector(self) -> Tensor:
        """The SWA mean as a flat vector (a copy)."""
        self._require_collected("mean_vector()")
        return self.mean.clone()

    def unflatten(self, vector: Tensor) -> dict[str, Tensor]:
        """Split a flat vector into ``{parameter name: tensor}`` shaped like the parameters."""
        if vector.shape != (self.num_parameters,):
            raise ValueError(
                f"expected a flat vector of {self.num_parameters} elements, got shape "
                f"{tuple(vector.shape)}"
            )
        pieces = torch.split(vector, self.numels)
        return {
            n: t.view(s) for n, t, s in zip(self.names, pieces, self.shapes, strict=True)
        }

    @torch.no_grad()
    def load_into(self, model: nn.Module, vector: Tensor) -> None:
        """Copy a flat vector (from :meth:`sample`, :meth:`mean_vector`) into ``model``."""
        params = self._check_model(model)
        for p, t in zip(params, self.unflatten(vector).values(), strict=True):
            p.copy_(t)

    # -- persistence ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume collection or sampling."""
        return {
            "diagonal": self.diagonal,
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "max_rank": self.max_rank,
            "n_collected": self.n_collected,
            "var_clamp": self.var_clamp,
            "mean": self.mean.clone(),
            "var": self.var.clone(),
            "deviations": self.deviations.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (for a posterior of the same model)."""
        keys = ("names", "shapes", "max_rank", "n_collected", "mean", "deviations")
        if "var" not in state and "sq_mean" not in state:
            raise KeyError("SWAG state dict lacks 'var'; expected state_dict() output")
        for key in keys:
            if key not in state:
                raise KeyError(f"SWAG state dict lacks {key!r}; expected state_dict() output")
        if list(state["names"]) != self.names or [tuple(s) for s in state["shapes"]] != self.shapes:
            raise ValueError("SWAG state dict was saved for a model with different parameters")
        if int(state["max_rank"]) != self.max_rank:
            raise ValueError(
                f"SWAG state dict has max_rank={state['max_rank']}, this posterior {self.max_rank}"
            )
        if bool(state.get("diagonal", False)) != self.diagonal:
            raise ValueError(f"SWAG state dict has diagonal={state.get('diagonal', False)}, this "
                             f"posterior diagonal={self.diagonal}")
        self.mean.copy_(state["mean"])
        if "var" in state:
            self.var.copy_(state["var"])
        else:  # written before the variance was stored
            self.var.copy_(torch.addcmul(state["sq_mean"].to(self.var), self.mean, self.mean,
                                         value=-1.0))
        self.deviations.copy_(state["deviations"])
        self.n_collected = int(state["n_collected"])
        self.var_clamp = float(state.get("var_clamp", self.var_clamp))


class MultiSWAG:
    """Several independently trained SWAG posteriors whose samples are pooled in one average."""

    def __init__(self, members: Sequence[SWAG]) -> None:
        members = list(members)
        if not members:
            raise ValueError("MultiSWAG needs at least one SWAG posterior")
        for i, m in enumerate(members):
            if not isinstance(m, SWAG):
                raise TypeError(f"member {i} is a {type(m).__name__}, expected SWAG")
            if m.names != members[0].names or m.shapes != members[0].shapes:
                raise ValueError(f"member {i} is built for a different model than member 0")
        self.members = members

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[SWAG]:
        return iter(self.members)

    def state_dict(self) -> dict[str, Any]:
        """The members' state dicts, in order."""
        return {"members": [m.state_dict() for m in self.members]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if len(state.get("members", ())) != len(self.members):
            raise ValueError(
                f"state dict holds {len(state.get('members', ()))} members, this MultiSWAG "
                f"{len(self.members)}"
            )
        for m, s in zip(self.members, state["members"], strict=True):
            m.load_state_dict(s)


@torch.no_grad()
def _predict(
    model: nn.Module, loader: Iterable[Any], forward: Forward, device: Any
) -> Tensor:
    probs = [
        torch.softmax(forward(model, to_device(batch, device)).float(), dim=-1)
        for batch in loader
    ]
    if not probs:
        raise ValueError("bayesian_average: the loader yielded no batches")
    return torch.cat(probs)


def bayesian_average(
    model: nn.Module,
    swag: SWAG | MultiSWAG,
    loader: Iterable[Any],
    n_samples: int = 30,
    *,
    bn_loader: Iterable[Any] | None = None,
    scale: float = 0.5,
    diag_only: bool = False,
    generator: torch.Generator | None = None,
    forward: Forward | None = None,
    device: torch.device | str | int | None = None,
    bn_max_batches: int | None = None,
) -> Tensor:
    """Class probabilities on ``loader`` averaged over ``n_samples`` SWAG samples.

    ``model`` (shaped like the posterior's model, returning logits) receives each sample in turn;
    BatchNorm statistics are recomputed on ``bn_loader`` after every sample (required when the
    model has such layers). For a :class:`MultiSWAG`, ``n_samples`` are drawn from each member and
    all are pooled. The loader must yield the batches in the same order on every pass. The model's
    parameters, buffers and mode are restored afterwards. Returns an ``(N, classes)`` tensor.
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an integer >= 1, got {n_samples!r}")
    members = list(swag) if isinstance(swag, MultiSWAG) else [swag]
    needs_bn = has_running_stats(model)
    if needs_bn and bn_loader is None:
        raise ValueError(
            "model has BatchNorm layers, whose statistics must be recomputed for each sample: "
            "pass bn_loader (training data)"
        )
    call = default_forward if forward is None else forward
    saved = copy.deepcopy(model.state_dict())
    was_training = {m: m.training for m in model.modules()}
    total: Tensor | None = None
    try:
        for member in members:
            for _ in range(n_samples):
                member.sample(scale, diag_only, generator, model=model)
                if needs_bn and bn_loader is not None:
                    update_bn(bn_loader, model, forward=forward, device=device,
                              max_batches=bn_max_batches)
                model.eval()
                probs = _predict(model, loader, call, device)
                total = probs if total is None else total.add_(probs)
    finally:
        model.load_state_dict(saved)
        for m, training in was_training.items():
            m.training = training
    assert total is not None
    return total / (n_samples * len(members))
