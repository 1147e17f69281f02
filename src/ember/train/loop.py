"""``fit``: an explicit training loop over ember.train's components.

One epoch reads the loader once. Every batch is a micro-batch; the stepping component decides
which closes an optimizer step (every ``accumulate``-th, or a Poisson batch's last physical
batch under privacy). Each concern (precision and steps, privacy, averaging, the rate schedule,
evaluation, the run's records, the metrics log, progress bars, checkpoints, the user's
callbacks) is a component of :mod:`ember.train.components`, called by hook name in that order;
the loop itself only reads batches and calls them. Checkpoints are taken only between optimizer
steps, so a resumed run repeats exactly what the interrupted one would have done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ember.swa import EMA, SWA, SWAG
from ember.train.checkpoint import find_checkpoint, load_checkpoint
from ember.train.components.averaging import Averaging
from ember.train.components.base import Run, StopTraining, call, close_all
from ember.train.components.callbacks import FunctionCallback, UserCallbacks
from ember.train.components.checkpointing import Checkpointing
from ember.train.components.evaluation import Evaluation
from ember.train.components.history import History
from ember.train.components.logging import MetricsLogger, ProgressBar
from ember.train.components.privacy import Privacy
from ember.train.components.schedule import RateSchedule, lr_of
from ember.train.components.stepping import Stepping
from ember.train.config import TrainConfig
from ember.train.distributed import World, init_from_env, shutdown
from ember.train.errors import ConfigError
from ember.train.inference import evaluate, predict, split_batch
from ember.train.privacy import PrivacyConfig

__all__ = ["StopTraining", "TrainConfig", "TrainResult", "evaluate", "fit", "predict"]


@dataclass
class TrainResult:
    """What :func:`fit` returns."""

    model: nn.Module
    swa: SWA | None
    swag: SWAG | None
    history: list[dict]  # one record per epoch: train_loss, lr, eval metrics, ...
    steps: int
    skipped_steps: int
    dropped_microbatches: int
    world_size: int
    rank: int
    generator: Any  # this rank's ember.csprng substream (an ember Generator)
    rank_digests: list[str]  # weights_digest of the model on every rank (all equal under DDP)
    checkpoint: Path | None
    epsilon: float | None = None  # with privacy: the budget spent (at PrivacyConfig.delta)
    noise_multiplier: float | None = None  # with privacy: the DP-SGD noise multiplier used
    ema: EMA | None = None  # with an EMA: the moving average of the weights
    privacy: dict | None = None  # with privacy: q, sigma, delta, steps, accountant, epsilon, ...
    stopped_early: bool = False  # ended before its epochs (budget stop or StopTraining)
    empty_steps: int = 0  # optimizer steps whose (Poisson) batch held no example


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds none of ``model``'s parameters: it would train nothing."""
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and not any(id(p) in own for p in held):
        raise ConfigError("the optimizer holds none of the model's parameters (was it built for "
                          "another model?); build it with optimizer(model.parameters(), ...)")


def _batches(loader: Iterable) -> Iterator:
    """``loader``'s batches, hiding its draws from torch's global generator from the model.

    A DataLoader draws a seed from the global generator when an epoch's iterator starts; a resumed
    run starts it at a different point, so without this dropout masks would differ after resuming.
    """
    it = iter(loader)
    while True:
        state = torch.get_rng_state()
        try:
            batch = next(it)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(state)
        yield batch


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, train_loader: Iterable,
        config: TrainConfig | None = None, *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        scheduler: LRScheduler | None = None, eval_loader: Iterable | None = None,
        bn_loader: Iterable | None = None,
        on_step: Callable[[int, dict], None] | None = None,
        privacy: PrivacyConfig | None = None,
        on_epoch: Callable[[int, dict], None] | None = None,
        callbacks: Sequence[Any] = ()) -> TrainResult:
    """Train ``model`` on ``(inputs, targets)`` batches from ``train_loader``.

    ``loss_fn(logits, targets)`` defaults to cross-entropy (logits are cast to float32 first).
    ``scheduler`` is stepped once per epoch (or per optimizer step, ``scheduler_interval="step"``)
    before the SWA phase. ``eval_loader`` (read on rank 0 only, so do not split it across ranks)
    adds test accuracy and NLL of every model kept (raw ``eval_*``, ``eval_ema_*``, and
    ``eval_swa_*`` with BatchNorm recomputed on ``bn_loader``) to each epoch's record.
    ``bn_loader`` recomputes the SWA model's BatchNorm statistics at the end.

    ``callbacks``: objects with any of ``on_fit_start()``, ``on_step_end(step, record)``,
    ``on_epoch_end(epoch, record)``, ``on_fit_end(result)`` and optionally ``state_dict()`` /
    ``load_state_dict()`` (kept in checkpoints); raising :class:`StopTraining` from a step or
    epoch hook ends the run cleanly. ``on_step(step, record)`` and ``on_epoch(epoch, record)``
    are the same as a callback's ``on_step_end``/``on_epoch_end`` (called after that step's or
    epoch's checkpoint, if any).

    Run under ``torchrun`` to train with DistributedDataParallel (gloo on CPU): each rank must
    read its own part of the data with the same number of batches (``ShardDataset(...,
    equalize="drop")``). A :class:`~ember.shards.ShardLoader` makes mid-epoch checkpoints exact.

    ``privacy`` trains with DP-SGD on Opacus's pieces (see :mod:`ember.train.privacy`), also
    under torchrun: each epoch's record carries the ``epsilon`` spent and the ``dp_*`` parameters,
    ``result.privacy`` the full report (``not_covered_by_dp`` names the fields epsilon does not
    cover); the returned model, EMA and SWA copies carry no Opacus hooks or attributes. A
    training step that changes a floating-point buffer of the model is refused (the buffers are
    put back).
    """
    config = config or TrainConfig()
    config.check()
    world = init_from_env()
    try:
        components, run, resume_from = _build(model, optimizer, train_loader, config, world,
                                              loss_fn, scheduler, eval_loader, bn_loader,
                                              privacy, list(callbacks), on_step, on_epoch)
        try:
            return _train(run, components)
        finally:
            close_all(components, run)
    finally:
        shutdown(world)


def _build(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Iterable,
           config: TrainConfig, world: World, loss_fn: Any, scheduler: LRScheduler | None,
           eval_loader: Iterable | None, bn_loader: Iterable | None,
           privacy: PrivacyConfig | None, callbacks: list[Any], on_step: Any, on_epoch: Any
           ) -> tuple[list[Any], Run, Path | None]:
    """The run's components in the order their hooks are called, and its shared state."""
    from ember.csprng import create_generator, create_random_device_generator

    _check_optimizer(model, optimizer)
    device = torch.device(config.device)
    model.to(device)
    base = create_generator(config.seed) if config.seed is not None \
        else create_random_device_generator()
    run = Run(model=model, net=model, optimizer=optimizer, loader=loader, config=config,
              world=world, device=device, generator=base.fold_in(world.rank))
    resume_from = find_checkpoint(config.checkpoint.resume, config.checkpoint.dir)
    run.resume_state = load_checkpoint(resume_from) if resume_from is not None else None
    stepping = Stepping(config, device, loss_fn or nn.functional.cross_entropy)
    averaging = Averaging(config, bn_loader)
    components: list[Any] = [stepping]
    if privacy is not None:
        components.append(Privacy(privacy, config.epochs, stepping))
    components += [averaging, RateSchedule(config, scheduler)]
    if eval_loader is not None:
        components.append(Evaluation(eval_loader, bn_loader, averaging, stepping.precision,
                                     config.swa.bn_batches if config.swa else None))
    components += [History(),
                   MetricsLogger(config.log.metrics_path, config.log.log_every, resume_from,
                                 {"precision": config.step.precision, "world_size": world.size,
                                  "epochs": config.epochs, "accumulate": config.step.accumulate}),
                   ProgressBar(config.log.progress, config.epochs)]
    # the user's callbacks before the checkpoint (their state in it includes the step or epoch it
    # closes), fit's on_step/on_epoch after it (called once that checkpoint is written)
    components.append(UserCallbacks(callbacks))
    checkpointing = Checkpointing(config.checkpoint.dir, config.checkpoint.every, components)
    components += [checkpointing, UserCallbacks([FunctionCallback(on_step, on_epoch)])]
    return components, run, resume_from


def _train(run: Run, components: list[Any]) -> TrainResult:
    call(components, "setup", run)
    call(components, "wrap", run)
    if run.resume_state is not None:
        next(c for c in components if isinstance(c, Checkpointing)).restore(run, run.resume_state)
    run.resume_state = None  # not kept: a private run's holds the noise key
    epochs = run.config.epochs
    call(components, "on_fit_start", run)
    stepping: Stepping = components[0]
    for epoch in range(run.progress.epoch, epochs):
        if run.stop:
            break
        _epoch(run, components, stepping, epoch)
    call(components, "on_fit_end", run)
    result = _result(run, components)
    for c in components:
        if isinstance(c, UserCallbacks):
            c.fit_ended(result)
    return result


def _epoch(run: Run, components: list[Any], stepping: Stepping, epoch: int) -> None:
    """One pass over the loader, then the epoch's record."""
    run.net.train()
    call(components, "on_epoch_start", run, epoch)
    p = run.progress
    for batch in _batches(run.loader):
        x, y = split_batch(batch, run.device)
        closes = stepping.closes_step(run)
        loss = stepping.backward(run, x, y, closes)
        call(components, "on_batch_end", run)
        p.micro += 1
        if loss is not None:  # an empty Poisson batch has no loss
            p.epoch_loss_sum += loss
            p.loss_batches += 1
        if not closes:
            stepping.batching.between_steps(run)
            continue
        _step(run, components, stepping, epoch, loss)
        if run.stop:
            break
    if p.micro == 0:
        raise ConfigError(f"train_loader yielded no batches in epoch {epoch} (is the data "
                          "empty, or was every sample skipped?)")
    record = {"epoch": epoch,
              "train_loss": p.epoch_loss_sum / p.loss_batches if p.loss_batches else None,
              "batches": p.micro, "steps": p.step, "skipped_steps": p.skipped_steps,
              "swa": run.config.swa is not None and run.config.swa.start is not None
              and epoch >= run.config.swa.start}
    errors = getattr(run.loader, "error_count", None)
    if errors is not None:  # shards/samples the loader's error handling skipped
        record["data_errors"] = int(errors)
    call(components, "on_epoch_end", run, record)


def _step(run: Run, components: list[Any], stepping: Stepping, epoch: int,
          loss: float | None) -> None:
    skipped, grad_norm = stepping.step(run)
    p = run.progress
    p.step += 1
    p.skipped_steps += skipped
    record: dict[str, Any] = {"step": p.step, "epoch": epoch, "loss": loss,
                              "lr": lr_of(run.optimizer), "skipped": skipped}
    if loss is None:  # the logical batch held no example (Poisson sampling)
        p.empty_steps += 1
        record["empty"] = True
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    call(components, "on_step_end", run, record)


def _result(run: Run, components: list[Any]) -> TrainResult:
    averaging = next(c for c in components if isinstance(c, Averaging))
    history = next(c for c in components if isinstance(c, History))
    private = next((c.private for c in components if isinstance(c, Privacy)), None)
    p = run.progress
    checkpoint = next(c for c in components if isinstance(c, Checkpointing)).path
    return TrainResult(
        model=run.model, swa=averaging.swa, swag=averaging.swag, history=p.history,
        steps=p.step, skipped_steps=p.skipped_steps, dropped_microbatches=p.dropped_microbatches,
        world_size=run.world.size, rank=run.world.rank, generator=run.generator,
        rank_digests=history.digests, checkpoint=checkpoint,
        epsilon=private.epsilon() if private is not None else None,
        noise_multiplier=private.noise_multiplier if private is not None else None,
        ema=averaging.ema, privacy=run.report.get("privacy"),
        stopped_early=run.stop or p.epoch < run.config.epochs, empty_steps=p.empty_steps)


