"""Removed: ember's home-made "secure gradient noise" (it was not differential privacy).

``GaussianGradientNoise`` added Gaussian noise to the clipped *batch* gradient and kept no privacy
budget, so it gave no (epsilon, delta) guarantee while looking like DP-SGD. Use
``ember.train.fit(..., privacy=PrivacyConfig(epsilon=..., delta=..., max_grad_norm=...))``, which runs
DP-SGD (per-example clipping, Poisson sampling, an accountant) through Opacus on ember.csprng.
"""

from __future__ import annotations

from typing import Any

from ember.train.errors import ConfigError

__all__ = ["GaussianGradientNoise"]

MIGRATION = ("ember.train.GaussianGradientNoise and TrainConfig.noise_multiplier were removed: they "
             "noised the clipped batch gradient and kept no privacy budget, which is not "
             "differential privacy. Use fit(..., privacy=PrivacyConfig(epsilon=..., delta=..., "
             "max_grad_norm=...)) from ember.train.privacy (DP-SGD through Opacus; docs/train.md)")


class GaussianGradientNoise:
    """Removed; constructing it raises :class:`ConfigError` pointing to ``fit(privacy=...)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(MIGRATION)
