"""Weight averaging and weight-space posteriors: SWA, EMA, SWAG, MultiSWAG, calibration metrics.

See ``docs/swa.md`` for the guide and the maturity of each feature.
"""

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
from ember.swa.multiswa import MultiSWA, train_multiswa
from ember.swa.plots import reliability_diagram
from ember.swa.quantize import BlockQuantizer, block_quantize
from ember.swa.schedules import CyclicSWALR, cyclic_lr, is_cycle_end
from ember.swa.subspace import Subspace, elliptical_slice_sampling, fit_vi, subspace_average
from ember.swa.swag import SWAG, MultiSWAG, bayesian_average
from ember.swa.swalp import LowPrecisionOptimizer, quantize_activations_
from ember.swa.swap import (
    SWAPResult,
    average_bn_stats_,
    refine_and_average,
    refine_locally,
    swap_average_,
    swap_fit,
    swap_world_size,
)

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
    "SWAPResult",
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
    "refine_and_average",
    "refine_locally",
    "reliability_diagram",
    "subspace_average",
    "swap_average_",
    "swap_fit",
    "swap_world_size",
    "train_multiswa",
    "update_bn",
]
