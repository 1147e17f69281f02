"""ember.train: an explicit training loop tying ember's subsystems together.

:func:`fit` trains on ``(inputs, targets)`` batches (typically from :func:`image_class_loader`,
streaming ember.shards) with fp32/bf16/fp16 precision, gradient accumulation and clipping, SWA and
SWAG collection, DP-SGD through Opacus on ember.csprng (``privacy=``), exact checkpoint/resume and
DistributedDataParallel under torchrun; the Multi-SWA and SWAP procedures built on it are in
:mod:`ember.train.recipes`. See docs/train.md.
"""

from ember.train.checkpoint import load_checkpoint, save_checkpoint, weights_digest
from ember.train.data import check_shards, image_class_loader, peek_image_shape
from ember.train.errors import ConfigError
from ember.train.loop import TrainConfig, TrainResult, evaluate, fit, predict
from ember.train.noise import GaussianGradientNoise
from ember.train.precision import PRECISIONS, Precision
from ember.train.privacy import PrivacyConfig
from ember.train.recipes import (
    SWAPResult,
    refine_and_average,
    refine_locally,
    swap_fit,
    train_multiswa,
)

__all__ = [
    "PRECISIONS",
    "ConfigError",
    "GaussianGradientNoise",
    "Precision",
    "PrivacyConfig",
    "SWAPResult",
    "TrainConfig",
    "TrainResult",
    "check_shards",
    "evaluate",
    "fit",
    "image_class_loader",
    "load_checkpoint",
    "peek_image_shape",
    "predict",
    "refine_and_average",
    "refine_locally",
    "save_checkpoint",
    "swap_fit",
    "train_multiswa",
    "weights_digest",
]
