"""ember.train: an explicit training loop tying ember's subsystems together.

:func:`fit` trains on ``(inputs, targets)`` batches (typically from :func:`image_class_loader`,
streaming ember.shards) with fp32/bf16/fp16 precision, gradient accumulation and clipping, SWA and
SWAG collection, DP-SGD through Opacus on ember.csprng (``privacy=``), exact checkpoint/resume and
DistributedDataParallel under torchrun; the Multi-SWA and SWAP procedures built on it are in
:mod:`ember.train.recipes`. See docs/train.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module defining it. Imported on first use, so that `ember train --help` (which
# imports ember.train.cli, and with it this package) does not import torch.
_EXPORTS = {
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "weights_digest": "checkpoint",
    "check_shards": "data", "image_class_loader": "data", "peek_image_shape": "data",
    "ConfigError": "errors",
    "TrainConfig": "config", "StepConfig": "config", "ScheduleConfig": "config",
    "SWAConfig": "config", "SWAGConfig": "config", "EMAConfig": "config",
    "CheckpointConfig": "config", "LogConfig": "config",
    "StopTraining": "components", "Component": "components",
    "TrainResult": "loop", "evaluate": "inference", "fit": "loop", "predict": "inference",
    "PRECISIONS": "precision", "Precision": "precision",
    "PrivacyConfig": "privacy",
    "SWAPResult": "recipes", "refine_and_average": "recipes", "refine_locally": "recipes",
    "swap_fit": "recipes", "train_multiswa": "recipes",
}

__all__ = [
    "PRECISIONS",
    "ConfigError",
    "CheckpointConfig",
    "Component",
    "EMAConfig",
    "LogConfig",
    "Precision",
    "PrivacyConfig",
    "SWAConfig",
    "SWAGConfig",
    "ScheduleConfig",
    "StepConfig",
    "StopTraining",
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

if TYPE_CHECKING:
    from ember.train.checkpoint import load_checkpoint, save_checkpoint, weights_digest
    from ember.train.components import Component, StopTraining
    from ember.train.config import (
        CheckpointConfig,
        EMAConfig,
        LogConfig,
        ScheduleConfig,
        StepConfig,
        SWAConfig,
        SWAGConfig,
        TrainConfig,
    )
    from ember.train.data import check_shards, image_class_loader, peek_image_shape
    from ember.train.errors import ConfigError
    from ember.train.inference import evaluate, predict
    from ember.train.loop import TrainResult, fit
    from ember.train.precision import PRECISIONS, Precision
    from ember.train.privacy import PrivacyConfig
    from ember.train.recipes import (
        SWAPResult,
        refine_and_average,
        refine_locally,
        swap_fit,
        train_multiswa,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ember.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
