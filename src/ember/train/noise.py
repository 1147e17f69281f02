"""Gaussian noise on clipped gradients, drawn from an ember.csprng generator (DP-SGD style).

This adds the noise of the Gaussian mechanism to the *clipped per-batch* gradient: after the
gradient's total norm is clipped to ``max_grad_norm``, every gradient element receives independent
``N(0, (noise_multiplier * max_grad_norm)^2)`` noise. It is not a differential-privacy accountant:
it neither clips per example nor tracks the privacy budget (epsilon, delta) spent; use a DP library
(for example Opacus, with an ember generator) for guarantees.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ember.train.distributed import World, average_
from ember.train.errors import ConfigError

__all__ = ["GaussianGradientNoise"]


class GaussianGradientNoise:
    """Adds ``N(0, (noise_multiplier * max_grad_norm)^2)`` to every gradient element.

    ``generator`` is this rank's stream. With several ranks, each draws noise ``sqrt(world)``
    times larger from its own stream and the ranks average it, so every rank applies the same
    noise of the stated size and no single rank knows it.
    """

    def __init__(self, noise_multiplier: float, max_grad_norm: float, generator: torch.Generator,
                 world: World | None = None) -> None:
        if not noise_multiplier > 0:
            raise ConfigError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        if not max_grad_norm > 0:
            raise ConfigError(f"gradient noise needs max_grad_norm > 0 (the clipping bound), "
                              f"got {max_grad_norm}")
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.generator = generator
        self.world = world or World()

    @property
    def std(self) -> float:
        """Standard deviation of the noise each gradient element receives."""
        return self.noise_multiplier * self.max_grad_norm

    @torch.no_grad()
    def add_(self, parameters: Iterable[nn.Parameter]) -> None:
        """Add noise to the ``.grad`` of each parameter that has one (in place)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return
        total = sum(g.numel() for g in grads)
        std = self.std * (self.world.size ** 0.5 if self.world.distributed else 1.0)
        flat = torch.randn(total, generator=self.generator, dtype=torch.float32)
        flat.mul_(std)
        average_(flat, self.world)
        offset = 0
        for g in grads:
            n = g.numel()
            g.add_(flat[offset:offset + n].view_as(g).to(device=g.device, dtype=g.dtype))
            offset += n
