"""``ember train``: the ember.train loop on your own image + class shards.

Single process: ``ember train --data 'shards/train-{000000..000009}.tar' --num-classes 10``.
Several processes (DDP, gloo on CPU): ``torchrun --nproc_per_node=2 --no-python ember train ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ember.train.errors import ConfigError
from ember.train.precision import PRECISIONS

__all__ = ["build_model", "register", "run"]

_EPILOG = """\
outputs (in --out, written by rank 0):
  checkpoints/last.pt  checkpoint after every epoch (and every --checkpoint-every steps)
  metrics.jsonl        one JSON object per step/epoch
  model.pt             final weights (state dict; with SWAP the averaged ones); swa.pt with
                       --swa-start
  summary.json         steps, skipped steps, per-epoch history, ranks_in_sync; with DP-SGD
                       "privacy": q, sigma, delta, steps, accountant, epsilon

data convention: each sample holds one image (png, jpg, jpeg, ppm, pgm, webp, ...) and an
integer class in a .cls member, as written by ember.shards.ShardWriter or webdataset.

several processes: torchrun --nproc_per_node=2 --no-python ember train --data ... (each rank reads
its own shards, the same number of batches each; checkpoints must be on a shared filesystem).
"""


def build_model(kind: str, input_shape: tuple[int, ...], num_classes: int, hidden: int) -> nn.Module:
    """A small classifier for images of ``input_shape`` = (channels, height, width)."""
    channels = input_shape[0]
    if kind == "mlp":
        features = 1
        for d in input_shape:
            features *= d
        return nn.Sequential(nn.Flatten(), nn.Linear(features, hidden), nn.ReLU(),
                             nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
    raise ConfigError(f"unknown model {kind!r}; expected 'mlp' or 'cnn'")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ember train`` to the ``ember`` command."""
    p = sub.add_parser(
        "train", help="train a classifier on your own image + cls shards",
        description="Train a small classifier on WebDataset-format image + class shards with "
        "ember.train: mixed precision, gradient accumulation, SWA/SWAG, optional secure gradient "
        "noise, exact checkpoint/resume, and DDP under torchrun.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, metavar="URLS",
                      help="training shards: a brace pattern such as 'shards/train-{000000..000009}"
                      ".tar' (quote it), local paths, file:, http(s)://, s3://")
    data.add_argument("--eval-data", metavar="URLS",
                      help="test shards evaluated after every epoch (accuracy, NLL)")
    data.add_argument("--num-classes", type=int, required=True, metavar="N",
                      help="number of classes; labels in .cls must lie in [0, N)")
    data.add_argument("--grayscale", action="store_true",
                      help="decode images as 1-channel grayscale (default: RGB)")
    data.add_argument("--shuffle-buffer", type=int, default=1000, metavar="N",
                      help="sample shuffle buffer; 0 reads in order (default: %(default)s)")
    data.add_argument("--workers", type=int, default=0, metavar="N",
                      help="DataLoader worker processes reading shards (default: %(default)s)")
    data.add_argument("--ray-address", default=None, metavar="ADDR",
                      help="read and decode the training shards with Ray tasks on this cluster "
                      "('auto', 'HOST:6379', 'ray://HOST:10001'; needs ember[ray]); every "
                      "process connects and gets its own equal share")
    model = p.add_argument_group("model and optimiser")
    model.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                       help="mlp: two hidden layers on flattened pixels; cnn: two conv layers "
                       "(default: %(default)s)")
    model.add_argument("--hidden", type=int, default=256, metavar="N",
                       help="hidden layer width (default: %(default)s)")
    model.add_argument("--epochs", type=int, default=10, help="epochs (default: %(default)s)")
    model.add_argument("--batch-size", type=int, default=64, metavar="N",
                       help="micro-batch size per process (default: %(default)s)")
    model.add_argument("--lr", type=float, default=0.05,
                       help="SGD learning rate, constant until SWA (default: %(default)s)")
    model.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    model.add_argument("--weight-decay", type=float, default=5e-4,
                       help="SGD weight decay (default: %(default)s)")
    loop = p.add_argument_group("training loop")
    loop.add_argument("--precision", choices=PRECISIONS, default="fp32",
                      help="fp32; bf16 autocast; fp16 autocast with GradScaler (overflowing steps "
                      "skipped and counted) (default: %(default)s)")
    loop.add_argument("--accumulate", type=int, default=1, metavar="K",
                      help="micro-batches per optimizer step (default: %(default)s)")
    loop.add_argument("--clip-grad-norm", type=float, default=None, metavar="C",
                      help="clip the total gradient norm to C (after fp16 unscaling)")
    loop.add_argument("--swa-start", type=int, default=None, metavar="EPOCH",
                      help="first epoch (0-based) of the SWA phase: SWALR to --swa-lr, SWA (and SWAG "
                      "with --swag-rank) collected after every epoch (default: no SWA)")
    loop.add_argument("--swa-lr", type=float, default=None, help="SWA learning rate (default: lr/2)")
    loop.add_argument("--swa-anneal-epochs", type=int, default=1, metavar="N",
                      help="epochs of cosine annealing to --swa-lr (default: %(default)s)")
    loop.add_argument("--swag-rank", type=int, default=0, metavar="K",
                      help="also collect a SWAG posterior of this deviation rank (the paper: 20); "
                      "0 collects SWA only (default: %(default)s)")
    dp = p.add_argument_group("differential privacy (DP-SGD through Opacus on ember.csprng)")
    dp.add_argument("--dp-epsilon", type=float, default=None, metavar="E",
                    help="train with DP-SGD for the budget (E, --dp-delta) over --epochs: the noise "
                    "multiplier is found for it; each epoch logs the epsilon spent")
    dp.add_argument("--dp-delta", type=float, default=None, metavar="D",
                    help="delta of the DP guarantee (below 1/dataset size, e.g. 1e-5)")
    dp.add_argument("--max-grad-norm", type=float, default=None, metavar="C",
                    help="per-example gradient clipping bound for DP-SGD")
    dp.add_argument("--dp-accountant", choices=("rdp", "prv"), default="rdp",
                    help="privacy accountant (default: %(default)s)")
    dp.add_argument("--dp-noise-multiplier", type=float, default=None, help=argparse.SUPPRESS)
    swap = p.add_argument_group(
        "SWAP (stochastic weight averaging in parallel; needs torchrun with >= 2 processes)")
    swap.add_argument("--swap-phase2-epochs", type=int, default=None, metavar="N",
                      help="after the --epochs of large-batch DDP training, every rank refines "
                      "alone for N epochs over all of --data in its own order, then the ranks' "
                      "weights are averaged and BatchNorm recomputed (default: no SWAP)")
    swap.add_argument("--swap-batch-size", type=int, default=None, metavar="B",
                      help="phase-2 batch size (default: --batch-size / 4, at least 1)")
    swap.add_argument("--swap-lr", type=float, default=None,
                      help="phase-2 learning rate (default: --lr)")
    swap.add_argument("--swap-bn-batches", type=int, default=50, metavar="N",
                      help="batches per rank for the BatchNorm recomputation (default: %(default)s)")
    loop.add_argument("--seed", type=int, default=0,
                      help="seed of the data shuffle and of the ember.csprng noise stream; -1 keys "
                      "the noise from the OS (default: %(default)s)")
    run_ = p.add_argument_group("outputs and resumption")
    run_.add_argument("--out", type=Path, default=Path("ember-train-out"), metavar="DIR",
                      help="output directory (default: %(default)s)")
    run_.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                      help="also checkpoint every STEPS optimizer steps (default: epoch ends only)")
    run_.add_argument("--resume", default=None, metavar="PATH|auto",
                      help="continue from a checkpoint file or directory; 'auto' resumes from "
                      "DIR/checkpoints/last.pt if it exists")
    run_.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except ConfigError as exc:
        print(f"ember train: error: {exc}", file=sys.stderr)
        return 2


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_classes", "hidden", "batch_size"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.num_classes < 2:
        raise ConfigError(f"--num-classes must be >= 2, got {args.num_classes}")
    if args.shuffle_buffer < 0 or args.workers < 0:
        raise ConfigError("--shuffle-buffer and --workers must be >= 0")
    if args.ray_address is not None and args.workers:
        raise ConfigError("--workers applies to local reading; with --ray-address the Ray "
                          "cluster's CPUs read the shards (drop --workers)")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if args.swag_rank < 0:
        raise ConfigError(f"--swag-rank must be >= 0, got {args.swag_rank}")
    if args.dp_noise_multiplier is not None:
        raise ConfigError("--dp-noise-multiplier was removed (it was not differential privacy); "
                          "use --dp-epsilon E --dp-delta D --max-grad-norm C")
    if args.swap_phase2_epochs is not None:
        if args.swap_phase2_epochs < 1:
            raise ConfigError(f"--swap-phase2-epochs must be >= 1, got {args.swap_phase2_epochs}")
        if args.swap_batch_size is not None and args.swap_batch_size < 1:
            raise ConfigError(f"--swap-batch-size must be >= 1, got {args.swap_batch_size}")
        if args.swap_lr is not None and not args.swap_lr > 0:
            raise ConfigError(f"--swap-lr must be > 0, got {args.swap_lr}")
        if args.swap_bn_batches < 1:
            raise ConfigError(f"--swap-bn-batches must be >= 1, got {args.swap_bn_batches}")
        if args.swa_start is not None or args.dp_epsilon is not None:
            raise ConfigError("--swap-phase2-epochs cannot be combined with --swa-start or DP-SGD")
    elif (args.swap_batch_size, args.swap_lr) != (None, None):
        raise ConfigError("--swap-batch-size and --swap-lr need --swap-phase2-epochs")
    dp = (args.dp_epsilon, args.dp_delta, args.max_grad_norm)
    if any(v is not None for v in dp) and any(v is None for v in dp):
        raise ConfigError("DP-SGD needs all of --dp-epsilon, --dp-delta and --max-grad-norm")


def _in_memory_loader(stream: object, batch_size: int, world: Any) -> torch.utils.data.DataLoader:
    """The whole training stream as a map-style DataLoader: DP-SGD's Poisson sampling picks
    examples by index, so the shards are read into memory once (by every rank, which samples
    its share; --batch-size stays per process)."""
    xs, ys = [], []
    for x, y in stream:  # type: ignore[attr-defined]
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ConfigError("--data holds no samples")
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    sampler = torch.utils.data.DistributedSampler(data, world.size, world.rank, shuffle=False) \
        if world.distributed else None
    return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler)


def _swap_phases(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: object, test: object, world: object) -> dict:
    """SWAP's phases 2 and 3 after fit's DDP phase: each rank refines alone over all the data
    in its own shuffle, then the weights are averaged and BatchNorm recomputed."""
    from ember.train.checkpoint import weights_digest
    from ember.train.data import image_class_loader
    from ember.train.distributed import all_gather_objects
    from ember.train.loop import evaluate
    from ember.train.recipes.swap import refine_and_average

    batch = args.swap_batch_size or max(1, args.batch_size // 4)
    small = image_class_loader(args.data, batch, seed=max(args.seed, 0) + 1 + world.rank,
                               shuffle=args.shuffle_buffer or 1000, grayscale=args.grayscale,
                               num_workers=args.workers, split_ranks=False)
    try:
        len(small)
        schedule = "linear"  # the paper's decay over phase 2
    except TypeError:
        schedule = "constant"  # a stream of unknown length: no end to decay towards
    losses, used = refine_and_average(
        model, optimizer, small, phase2_epochs=args.swap_phase2_epochs, phase2_lr=args.swap_lr,
        phase2_schedule=schedule, bn_batches=args.swap_bn_batches, loss_fn=loss_fn)
    digests = all_gather_objects(weights_digest(model), world)
    record = {"phase2_epochs": args.swap_phase2_epochs, "phase2_batch_size": batch,
              "phase2_schedule": schedule,
              "phase2_losses": all_gather_objects(losses, world), "bn_batches": used,
              "rank_digests": digests, "ranks_equal": len(set(digests)) == 1}
    if test is not None and world.is_main:
        record.update({f"eval_{k}": v for k, v in evaluate(model, test).items()})
    return record


def run(args: argparse.Namespace) -> int:
    """Train as the parsed ``ember train`` arguments say; returns the exit status."""
    from ember.train.data import check_shards, image_class_loader, peek_image_shape
    from ember.train.distributed import all_gather_objects, init_from_env
    from ember.train.loop import TrainConfig, fit

    _check_args(args)
    check_shards(args.data, "--data")
    if args.eval_data:
        check_shards(args.eval_data, "--eval-data")
    config = TrainConfig(
        epochs=args.epochs, precision=args.precision, accumulate=args.accumulate,
        max_grad_norm=args.clip_grad_norm, swa_start=args.swa_start,
        swa_lr=(args.swa_lr if args.swa_lr is not None else args.lr / 2)
        if args.swa_start is not None else args.swa_lr,
        swa_anneal_epochs=args.swa_anneal_epochs, swag_rank=args.swag_rank or None,
        seed=None if args.seed == -1 else args.seed,
        checkpoint_dir=args.out / "checkpoints", checkpoint_every=args.checkpoint_every,
        resume=args.resume, metrics_path=args.out / "metrics.jsonl", progress=not args.no_progress)
    config.check()
    privacy = None
    if args.dp_epsilon is not None:
        from ember.train.privacy import PrivacyConfig

        privacy = PrivacyConfig(epsilon=args.dp_epsilon, delta=args.dp_delta,
                                max_grad_norm=args.max_grad_norm, accountant=args.dp_accountant)
        privacy.check()

    world = init_from_env()  # before building loaders, so each rank reads its own shards
    if args.swap_phase2_epochs is not None and not world.distributed:
        raise ConfigError("SWAP (--swap-phase2-epochs) needs at least 2 processes, got a world "
                          "size of 1: run under torchrun --nproc_per_node=N with N >= 2")
    torch.manual_seed(max(args.seed, 0))  # the same initial weights on every rank
    shape = peek_image_shape(args.data, grayscale=args.grayscale)
    model = build_model(args.model, shape, args.num_classes, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    if privacy is None:
        train = image_class_loader(args.data, args.batch_size, seed=max(args.seed, 0),
                                   shuffle=args.shuffle_buffer, grayscale=args.grayscale,
                                   num_workers=args.workers, ray_address=args.ray_address)
        if args.ray_address is not None:
            try:
                train.connect()
            except (ImportError, ConnectionError) as exc:
                raise ConfigError(f"--ray-address: {exc}") from None
    elif args.ray_address is not None:
        raise ConfigError("--ray-address cannot be combined with --dp-epsilon: DP-SGD samples "
                          "every batch from all examples held in memory")
    else:  # all of --data on every rank, in shard order
        train = _in_memory_loader(image_class_loader(
            args.data, args.batch_size, shuffle=0, grayscale=args.grayscale,
            num_workers=args.workers, split_ranks=False), args.batch_size, world)
    test = None
    if args.eval_data:
        test = image_class_loader(args.eval_data, 256, shuffle=0, grayscale=args.grayscale,
                                  split_ranks=False)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= args.num_classes):
            raise ConfigError(f"a .cls label is outside [0, --num-classes={args.num_classes}): "
                              f"got labels in [{int(target.min())}, {int(target.max())}]")
        return nn.functional.cross_entropy(logits, target)

    try:
        def on_epoch(epoch: int, record: dict) -> None:
            if world.is_main and "epsilon" in record:
                print(f"epoch {epoch + 1}/{args.epochs}: epsilon {record['epsilon']:.4f} "
                      f"(delta {record['dp_delta']:g}, {record['dp_steps']} steps)", flush=True)

        result = fit(model, optimizer, train, config, loss_fn=loss_fn, eval_loader=test,
                     privacy=privacy, on_epoch=on_epoch)
        swap_record = _swap_phases(args, result.model, optimizer, loss_fn, test, world) \
            if args.swap_phase2_epochs is not None else None
        streams = all_gather_objects(
            hashlib.sha256(bytes(result.generator.get_state().numpy())).hexdigest()[:16], world)
    finally:
        from ember.train.distributed import shutdown

        shutdown(world)
    if world.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(result.model.state_dict(), args.out / "model.pt")
        if result.swa is not None:
            torch.save(result.swa.module.state_dict(), args.out / "swa.pt")
        summary = {"steps": result.steps, "skipped_steps": result.skipped_steps,
                   "dropped_microbatches": result.dropped_microbatches,
                   "world_size": result.world_size, "rank_digests": result.rank_digests,
                   "ranks_in_sync": len(set(result.rank_digests)) == 1,
                   "rank_streams": streams, "history": result.history,
                   "epsilon": result.epsilon, "noise_multiplier": result.noise_multiplier,
                   "privacy": result.privacy}
        if swap_record is not None:
            summary["swap"] = swap_record
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        last = result.history[-1] if result.history else {}
        print(f"trained {result.steps} steps on {result.world_size} process(es); final train loss "
              f"{last.get('train_loss', float('nan')):.4f}"
              + (f", test accuracy {last['eval_accuracy']:.4f}" if "eval_accuracy" in last else ""))
        if swap_record is not None and "eval_accuracy" in swap_record:
            print(f"SWAP average of {result.world_size} ranks: test accuracy "
                  f"{swap_record['eval_accuracy']:.4f}")
        print(f"outputs in {args.out}")
    return 0
