"""Weight averaging and weight-space posteriors: SWA, EMA, SWAG, MultiSWAG, calibration metrics.

Averaging and ensemble objects any training loop can use (as ``torch.optim.swa_utils``); the
procedures that run training (Multi-SWA, SWAP) are in :mod:`ember.train.recipes`. See
``docs/swa.md`` for the guide and the maturity of each feature.
"""

import warnings as _warnings
from typing import Any as _Any

from ember.swa.averaging import (
    EMA,
    SWA,
    SWALR,
    AveragedModel,
    ema_decay,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_avg_fn,
    get_swa_multi_avg_fn,
)
from ember.swa.bn import update_bn
from ember.swa.fastswa import FastSWA, FastSWASchedule
from ember.swa.metrics import (
    accuracy,
    brier_score,
    calibration_bins,
    expected_calibration_error,
    nll,
    predictive_entropy,
)
from ember.swa.multiswa import MultiSWA
from ember.swa.plots import reliability_diagram
from ember.swa.quantize import BlockQuantizer, block_quantize
from ember.swa.schedules import CyclicSWALR, cyclic_lr, is_cycle_end
from ember.swa.subspace import Subspace, elliptical_slice_sampling, fit_vi, subspace_average
from ember.swa.swag import SWAG, MultiSWAG, bayesian_average
from ember.swa.swalp import LowPrecisionOptimizer, quantize_activations_
from ember.swa.swap import average_bn_stats_, swap_average_, swap_world_size

__all__ = [
    "EMA",
    "FastSWA",
    "FastSWASchedule",
    "SWA",
    "SWAG",
    "SWALR",
    "Subspace",
    "AveragedModel",
    "BlockQuantizer",
    "CyclicSWALR",
    "MultiSWA",
    "MultiSWAG",
    "accuracy",
    "average_bn_stats_",
    "bayesian_average",
    "brier_score",
    "calibration_bins",
    "cyclic_lr",
    "block_quantize",
    "ema_decay",
    "elliptical_slice_sampling",
    "expected_calibration_error",
    "fit_vi",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
    "is_cycle_end",
    "LowPrecisionOptimizer",
    "nll",
    "predictive_entropy",
    "quantize_activations_",
    "reliability_diagram",
    "subspace_average",
    "swap_average_",
    "swap_world_size",
    "update_bn",
]

# moved to ember.train.recipes (they run training); the old names warn until ember 0.2
_MOVED = {"train_multiswa": "multiswa", "SWAPResult": "swap", "refine_and_average": "swap",
          "refine_locally": "swap", "swap_fit": "swap"}


def __getattr__(name: str) -> _Any:
    if name in _MOVED:
        from ember.train import recipes as _recipes  # deprecation shim, see _MOVED

        _warnings.warn(f"ember.swa.{name} has moved to ember.train.recipes.{_MOVED[name]}.{name}; "
                       "the old path will be removed in ember 0.2", DeprecationWarning,
                       stacklevel=2)
        return getattr(_recipes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # the moved names stay discoverable (help(), completion); `from ... import *` skips them, since
    # star imports read __all__, which may not name them without importing ember.train
    return sorted(set(globals()) | set(_MOVED))
