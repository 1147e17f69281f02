"""Subspace Inference (Izmailov et al., 2019): Bayesian model averaging in a low-dimensional
weight subspace around the SWA solution.

A :class:`Subspace` is an affine map ``w = shift + z @ basis`` from ``K`` coordinates ``z`` to the
``P`` flat weights. It is built from a :class:`ember.swa.SWAG` posterior (SWA mean and PCA of its
deviation matrix) or from a stored trajectory of flat weights. Posterior samples over ``z`` come
from :func:`elliptical_slice_sampling` (Murray, Adams & MacKay, 2010) or from a diagonal Gaussian
fitted by :func:`fit_vi`; :func:`subspace_average` turns them into weights and averages the
predictions, recomputing BatchNorm statistics for every sample.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ember.swa._batches import unwrap_compiled, unwrapped_named_parameters
from ember.swa.bn import has_running_stats, update_bn

__all__ = [
    "Subspace",
    "elliptical_slice_sampling",
    "fit_vi",
    "subspace_average",
    "subspace_log_likelihood",
]

LogLikelihood = Callable[[Tensor], Tensor]


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class Subspace:
    """The affine subspace ``w = shift + z @ basis`` of flat weight vectors.

    ``shift`` is ``(P,)``; ``basis`` is ``(K, P)`` with linearly independent rows. ``names`` and
    ``shapes`` (optional) describe the parameters the flat vector is split into, in the order of
    ``model.named_parameters()``; they are needed by :meth:`load_into`.
    """

    def __init__(self, shift: Tensor, basis: Tensor, *, names: Sequence[str] | None = None,
                 shapes: Sequence[Sequence[int]] | None = None) -> None:
        if shift.dim() != 1:
            raise ValueError(f"shift must be a flat (P,) vector, got shape {tuple(shift.shape)}")
        if basis.dim() != 2 or basis.shape[1] != shift.shape[0] or basis.shape[0] < 1:
            raise ValueError(
                f"basis must be (K, P) with K >= 1 and P = {shift.shape[0]}, got shape "
                f"{tuple(basis.shape)}")
        self.shift = shift.detach().clone()
        self.basis = basis.detach().to(shift.dtype).clone()
        self.names = None if names is None else list(names)
        self.shapes = None if shapes is None else [tuple(s) for s in shapes]
        if (self.names is None) != (self.shapes is None):
            raise ValueError("pass both names and shapes, or neither")
        if self.shapes is not None:
            total = sum(math.prod(s) for s in self.shapes)
            if total != shift.shape[0]:
                raise ValueError(f"shapes hold {total} elements but shift has {shift.shape[0]}")
        gram = self.basis @ self.basis.t()
        if torch.linalg.matrix_rank(gram) < gram.shape[0]:
            raise ValueError(f"basis rows are linearly dependent (rank "
                             f"{int(torch.linalg.matrix_rank(gram))} < K = {gram.shape[0]})")
        self._gram_inv = torch.linalg.inv(gram)

    @property
    def rank(self) -> int:
        """Number of coordinates ``K``."""
        return int(self.basis.shape[0])

    @property
    def num_parameters(self) -> int:
        """Length ``P`` of the flat weight vector."""
        return int(self.shift.shape[0])

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_trajectory(cls, weights: Tensor | Sequence[Tensor], rank: int, *,
                        shift: Tensor | None = None, svd: str = "exact", n_iter: int = 6,
                        names: Sequence[str] | None = None,
                        shapes: Sequence[Sequence[int]] | None = None) -> Subspace:
        """PCA subspace of a trajectory of flat weights (``(T, P)`` or a list of ``(P,)``).

        The shift is the trajectory's mean (or ``shift``); the basis rows are the top ``rank``
        principal directions of the deviations from the shift, scaled by ``sigma_i / sqrt(T-1)``
        (the paper's choice, so a unit coordinate is one standard deviation along it). ``svd`` is
        ``"exact"`` (``torch.linalg.svd``) or ``"randomized"`` (``torch.svd_lowrank`` with
        ``n_iter`` power iterations).
        """
        w = torch.stack(list(weights)) if not isinstance(weights, Tensor) else weights
        if w.dim() != 2:
            raise ValueError(f"weights must be (T, P), got shape {tuple(w.shape)}")
        center = w.mean(0) if shift is None else shift
        return cls._from_deviations(w - center, center, rank, svd=svd, n_iter=n_iter,
                                    names=names, shapes=shapes, what="iterates")

    @classmethod
    def from_swag(cls, swag: Any, rank: int | None = None, *, svd: str = "exact",
                  n_iter: int = 6) -> Subspace:
        """Subspace from a :class:`ember.swa.SWAG` posterior: shift = its SWA mean, basis = PCA
        of its deviation matrix (``rank`` defaults to all stored deviations)."""
        if getattr(swag, "diagonal", False):
            raise ValueError("a diagonal SWAG keeps no deviation matrix; use SWAG(diagonal=False)")
        dev = swag.deviation_matrix()
        rank = dev.shape[0] if rank is None else rank
        return cls._from_deviations(dev, swag.mean_vector(), rank, svd=svd, n_iter=n_iter,
                                    names=swag.names, shapes=swag.shapes,
                                    what="stored SWAG deviations", centered=False)

    @classmethod
    def _from_deviations(cls, dev: Tensor, shift: Tensor, rank: int, *, svd: str, n_iter: int,
                         names: Any, shapes: Any, what: str,
                         centered: bool = True) -> Subspace:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        t = dev.shape[0]
        limit = t - 1 if centered else t
        if rank > limit:
            need = rank + 1 if centered else rank
            raise ValueError(
                f"rank {rank} is larger than the {limit} directions {t} {what} can span: "
                f"need at least {need}")
        if svd == "exact":
            _, s, vh = torch.linalg.svd(dev, full_matrices=False)
            s, vh = s[:rank], vh[:rank]
        elif svd == "randomized":
            _, s, v = torch.svd_lowrank(dev, q=min(rank + 2, min(dev.shape)), niter=n_iter,
                                        M=None)
            s, vh = s[:rank], v[:, :rank].t()
        else:
            raise ValueError(f"svd must be 'exact' or 'randomized', got {svd!r}")
        if not bool((s > s[0] * 1e-6).all()):
            raise ValueError(
                f"the {what} span fewer than {rank} independent directions "
                f"(singular values {s.tolist()}); lower rank")
        basis = vh * (s / math.sqrt(max(t - 1, 1)))[:, None]
        return cls(shift, basis, names=names, shapes=shapes)

    # -- maps ----------------------------------------------------------------------------------

    def project(self, weights: Tensor) -> Tensor:
        """Coordinates ``z`` (``(K,)`` or ``(N, K)``) of the point of the subspace closest to
        ``weights`` (``(P,)`` or ``(N, P)``) in Euclidean distance."""
        if weights.shape[-1] != self.num_parameters:
            raise ValueError(
                f"expected weights with {self.num_parameters} elements in the last dimension, got "
                f"shape {tuple(weights.shape)}")
        return (weights.to(self.shift.dtype) - self.shift) @ self.basis.t() @ self._gram_inv

    def reconstruct(self, z: Tensor) -> Tensor:
        """Flat weights ``shift + z @ basis`` for coordinates ``(K,)`` or ``(N, K)``."""
        if z.shape[-1] != self.rank:
            raise ValueError(f"expected coordinates with {self.rank} elements in the last "
                             f"dimension, got shape {tuple(z.shape)}")
        return self.shift + z.to(self.basis.dtype) @ self.basis

    def _check_model(self, model: nn.Module) -> list[Tensor]:
        params = unwrapped_named_parameters(model)
        names = [n for n, _ in params]
        if self.names is None or self.shapes is None:  # set together (checked in __init__)
            if sum(p.numel() for _, p in params) != self.num_parameters:
                raise ValueError(
                    f"model has {sum(p.numel() for _, p in params)} parameters, the subspace "
                    f"{self.num_parameters}")
            return [p for _, p in params]
        by_name = dict(params)
        missing = [n for n in self.names if n not in by_name]
        if missing:
            raise ValueError(f"model lacks parameters of the subspace: {missing[:5]}")
        out = []
        for n, s in zip(self.names, self.shapes, strict=True):
            if tuple(by_name[n].shape) != s:
                raise ValueError(f"parameter {n!r} has shape {tuple(by_name[n].shape)}, the "
                                 f"subspace expects {s}")
            out.append(by_name[n])
        del names
        return out

    @torch.no_grad()
    def load_into(self, model: nn.Module, weights: Tensor) -> None:
        """Copy a flat weight vector (e.g. ``reconstruct(z)``) into ``model``'s parameters."""
        params = self._check_model(model)
        if weights.shape != (self.num_parameters,):
            raise ValueError(f"expected a flat ({self.num_parameters},) vector, got shape "
                             f"{tuple(weights.shape)}")
        for p, t in zip(params, torch.split(weights, [p.numel() for p in params]), strict=True):
            p.copy_(t.view_as(p))

    def functional_params(self, model: nn.Module, z: Tensor) -> dict[str, Tensor]:
        """``{name: tensor}`` of the weights at ``z``, differentiable in ``z`` (for
        ``torch.func.functional_call``)."""
        params = self._check_model(model)
        names = self.names or [n for n, _ in unwrapped_named_parameters(model)]
        w = self.reconstruct(z)
        pieces = torch.split(w, [p.numel() for p in params])
        return {n: t.view_as(p).to(p.dtype) for n, t, p in zip(names, pieces, params,
                                                                 strict=True)}

    # -- persistence ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Shift, basis and parameter layout."""
        return {"shift": self.shift.clone(), "basis": self.basis.clone(), "names": self.names,
                "shapes": self.shapes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        other = Subspace(state["shift"], state["basis"], names=state.get("names"),
                         shapes=state.get("shapes"))
        self.__dict__.update(other.__dict__)


# -- log likelihood -----------------------------------------------------------------------------

def subspace_log_likelihood(model: nn.Module, subspace: Subspace, batches: Sequence[Any], *,
                            loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
                            ) -> LogLikelihood:
    """``z -> -sum of loss_fn over batches`` at the weights ``subspace.reconstruct(z)``.

    ``batches`` is a bounded sequence of ``(inputs, targets)``; ``loss_fn(logits, targets)``
    returns the per-batch mean (cross-entropy by default) and is multiplied by the batch size.
    The model is called through ``torch.func.functional_call`` in its current mode (put it in
    ``eval()`` so BatchNorm uses fixed statistics); the result is differentiable in ``z``.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty: the log-likelihood needs data")
    call = loss_fn or nn.functional.cross_entropy

    def log_likelihood(z: Tensor) -> Tensor:
        params = subspace.functional_params(model, z)
        total = torch.zeros((), dtype=subspace.shift.dtype)
        for x, y in batches:
            logits = torch.func.functional_call(unwrap_compiled(model), params, (x,))
            total = total + call(logits.float(), y) * len(y)
        return -total

    return log_likelihood


# -- elliptical slice sampling ------------------------------------------------------------------

def _randn(shape: tuple[int, ...], generator: Any, dtype: torch.dtype) -> Tensor:
    return torch.randn(shape, generator=generator, dtype=dtype)


def _rand(generator: Any, dtype: torch.dtype) -> float:
    return float(torch.rand((), generator=generator, dtype=dtype))


@torch.no_grad()
def elliptical_slice_sampling(log_likelihood: LogLikelihood, initial: Tensor, n_samples: int,
                              *, prior_scale: float = 1.0, temperature: float = 1.0,
                              burn_in: int = 0, thin: int = 1, generator: Any = None,
                              max_shrinks: int = 1000) -> Tensor:
    """Draw ``n_samples`` coordinates from ``N(z; 0, prior_scale^2 I) * L(z)^(1/temperature)``.

    ``log_likelihood(z)`` returns ``log L(z)`` as a scalar tensor. ``initial`` is the starting
    point ``(K,)``. The chain runs ``burn_in`` discarded steps, then keeps every ``thin``-th
    state. Randomness (normals and uniforms) comes from ``generator`` (a ``torch.Generator`` or
    an ember.csprng generator). Returns ``(n_samples, K)``.
    """
    prior_scale = _check_positive("prior_scale", prior_scale)
    temperature = _check_positive("temperature", temperature)
    for name, v, least in (("n_samples", n_samples, 1), ("burn_in", burn_in, 0), ("thin", thin, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
    if initial.dim() != 1:
        raise ValueError(f"initial must be a (K,) vector, got shape {tuple(initial.shape)}")
    dtype = initial.dtype if initial.is_floating_point() else torch.float64

    def tempered(z: Tensor) -> float:
        value = float(log_likelihood(z)) / temperature
        return value if not math.isnan(value) else -math.inf

    z = initial.to(dtype).clone()
    ll = tempered(z)
    if ll == -math.inf:
        raise ValueError("log_likelihood(initial) is -inf or nan: start the chain elsewhere")
    out = torch.empty(n_samples, z.shape[0], dtype=dtype)
    kept = 0
    step = 0
    while kept < n_samples:
        nu = _randn(tuple(z.shape), generator, dtype) * prior_scale
        log_y = ll + math.log(_rand(generator, dtype) or 1e-300)
        theta = _rand(generator, dtype) * 2 * math.pi
        lo, hi = theta - 2 * math.pi, theta
        for _ in range(max_shrinks):
            cand = z * math.cos(theta) + nu * math.sin(theta)
            cand_ll = tempered(cand)
            if cand_ll > log_y:
                z, ll = cand, cand_ll
                break
            if theta < 0:
                lo = theta
            else:
                hi = theta
            theta = lo + _rand(generator, dtype) * (hi - lo)
        else:
            raise RuntimeError(f"elliptical slice sampling: no acceptable point after "
                               f"{max_shrinks} shrinks (is the log-likelihood finite?)")
        step += 1
        if step > burn_in and (step - burn_in) % thin == 0:
            out[kept] = z
            kept += 1
    return out


# -- variational inference ----------------------------------------------------------------------

def fit_vi(log_likelihood: LogLikelihood, dim: int, *, prior_scale: float = 1.0,
           temperature: float = 1.0, steps: int = 500, lr: float = 0.05, n_mc: int = 8,
           init_std: float = 0.1, generator: Any = None) -> tuple[Tensor, Tensor]:
    """Fit ``q(z) = N(mu, diag(sigma^2))`` to the tempered posterior of
    :func:`elliptical_slice_sampling` by maximizing the reparameterized ELBO with Adam.

    ``log_likelihood`` must be differentiable. The ELBO per step is estimated with ``n_mc``
    draws; the KL to the prior ``N(0, prior_scale^2 I)`` is analytic; the learning rate decays
    (cosine) to ``lr / 100``. Returns ``(mu, sigma)``.
    """
    prior_scale = _check_positive("prior_scale", prior_scale)
    temperature = _check_positive("temperature", temperature)
    for name, v in (("dim", dim), ("steps", steps), ("n_mc", n_mc)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    mu = torch.zeros(dim, dtype=torch.float64, requires_grad=True)
    log_sigma = torch.full((dim,), math.log(init_std), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([mu, log_sigma], lr=lr)
    # cosine decay to 1% of lr: the Monte Carlo ELBO gradient is noisy, a constant step leaves
    # the fit jittering around the optimum
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=lr * 0.01)
    for _ in range(steps):
        eps = _randn((n_mc, dim), generator, torch.float64)
        sigma = log_sigma.exp()
        z = mu + sigma * eps
        expected_ll = torch.stack([log_likelihood(zi) for zi in z]).mean() / temperature
        kl = 0.5 * ((sigma ** 2 + mu ** 2) / prior_scale ** 2 - 1
                    - 2 * log_sigma + 2 * math.log(prior_scale)).sum()
        loss = kl - expected_ll
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return mu.detach(), log_sigma.detach().exp()


# -- Bayesian model averaging -------------------------------------------------------------------

@torch.no_grad()
def subspace_average(model: nn.Module, subspace: Subspace, coordinates: Tensor,
                     loader: Iterable[Any], *, bn_loader: Iterable[Any] | None = None,
                     bn_max_batches: int | None = None) -> Tensor:
    """Class probabilities on ``loader`` averaged over the weights of every row of
    ``coordinates`` (``(S, K)``), BatchNorm statistics recomputed on ``bn_loader`` per sample.

    Batches are ``(inputs, targets)`` or inputs; the model returns logits. The model's state and
    mode are restored afterwards. Returns ``(N, classes)``.
    """
    if coordinates.dim() != 2 or coordinates.shape[0] < 1:
        raise ValueError(f"coordinates must be (S, K) with S >= 1, got shape "
                         f"{tuple(coordinates.shape)}")
    needs_bn = has_running_stats(model)
    if needs_bn and bn_loader is None:
        raise ValueError("model has BatchNorm layers, whose statistics must be recomputed for "
                         "each sample: pass bn_loader (training data)")
    saved = copy.deepcopy(model.state_dict())
    modes = {m: m.training for m in model.modules()}
    total: Tensor | None = None
    try:
        for z in coordinates:
            subspace.load_into(model, subspace.reconstruct(z))
            if needs_bn and bn_loader is not None:
                update_bn(bn_loader, model, max_batches=bn_max_batches)
            model.eval()
            probs = torch.cat([
                torch.softmax(model(b[0] if isinstance(b, (tuple, list)) else b).float(), -1)
                for b in loader])
            total = probs if total is None else total.add_(probs)
    finally:
        model.load_state_dict(saved)
        for m, mode in modes.items():
            m.training = mode
    assert total is not None
    return total / coordinates.shape[0]
