"""``ember train``: the ember.train loop on your own image + class shards.

Single process: ``ember train --data 'shards/train-{000000..000009}.tar' --num-classes 10``.
Several processes (DDP, gloo on CPU): ``torchrun --nproc_per_node=2 --no-python ember train ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.train.errors import ConfigError
from ember.train.options import Option, Rule, options_of, violation

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["build_model", "register", "run"]

# the precisions of ember.train.precision.PRECISIONS, here so that `ember --help` and argument
# parsing do not import torch
_PRECISIONS = ("fp32", "bf16", "fp16")

# files of a run in --out: a new run refuses to replace them without --force
_RUN_FILES = ("model.pt", "swa.pt", "ema.pt", "swag.pt", "summary.json", "metrics.jsonl",
              "checkpoints/last.pt")

# without --image-size, images whose first one has a side above this are fitted to this square
_DEFAULT_MAX_SIDE = 64
# bounds that keep a typo from allocating the machine away (a clear error instead)
_MAX_PARAMETERS = 2**28
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
_MAX_BATCH_BYTES = 2**32  # 4 GiB of float32 pixels per batch
# bounds of the command's own options that keep a typo from allocating the machine away (the
# config options carry theirs)
_LIMITS = {"hidden": 2**20, "batch_size": 2**20, "workers": 1024, "shuffle_buffer": 10**8,
           "swap_phase2_epochs": 10**6, "swap_batch_size": 2**20, "swap_bn_batches": 10**9,
           "num_classes": 10**6}

_EPILOG = """\
outputs (in --out, written by rank 0):
  checkpoints/last.pt  checkpoint after every epoch (and every --checkpoint-every steps); with
                       DP-SGD it holds the noise key (anyone holding it can strip the noise):
                       owner-only (0600), removed after a successful run unless
                       --keep-checkpoints; never publish it with the model
  metrics.jsonl        one JSON object per step/epoch
  model.pt             final weights (state dict; with SWAP the averaged ones); swa.pt with
                       --swa-start, ema.pt with --ema-decay, swag.pt (the posterior) with
                       --swag-rank
  summary.json         steps, skipped and empty steps, per-epoch history, epochs_done,
                       ranks_in_sync; "swag": its Bayesian average's test metrics; with
                       DP-SGD "privacy": q, sigma, delta, steps, accountant, epsilon, and
                       "not_covered_by_dp": the fields epsilon does not cover (train_loss, ...);
                       with --skip-bad "skipped_bad_items": each skipped shard/sample

data convention: each sample holds one image (png, jpg, jpeg, ppm, pgm, webp, ...) and an
integer class in a .cls member, as written by `ember shards create FOLDER -o PATTERN` (from a
folder with one subfolder of images per class), ember.shards.ShardWriter or webdataset. Images of
any size and mode: each is converted to RGB (or grayscale), scaled (bilinear, aspect kept) until it
covers --image-size and center-cropped to it (torchvision's Resize + CenterCrop). The class names
of a classes.json next to the shards (written by `ember shards create`) name the classes in the
summary and give the default --num-classes.

bad data: a corrupt or truncated shard, an image that does not decode or a sample without .cls
stops the run with one line naming the shard, the sample and the cause (exit status 2);
--skip-bad skips it instead (the rest of a bad shard, or the bad sample) and counts it in the
summary.

several processes: torchrun --nproc_per_node=2 --no-python ember train --data ... (each rank reads
its own shards, the same number of batches each; checkpoints must be on a shared filesystem).
"""


def build_model(kind: str, input_shape: tuple[int, ...], num_classes: int, hidden: int) -> nn.Module:
    """A small classifier for images of ``input_shape`` = (channels, height, width)."""
    from torch import nn

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


# argparse group title -> which config options it offers (TrainConfig's by group, PrivacyConfig's)
_FLAG_GROUPS = (("training loop", ("", "step", "schedule", "checkpoint")),
                ("SWA and SWAG (stochastic weight averaging and its Gaussian posterior)",
                 ("swa", "swag")),
                ("EMA (an exponential moving average of the weights)", ("ema",)),
                ("differential privacy (DP-SGD through Opacus on ember.csprng)", ("privacy",)))
# the CLI's own defaults where they differ from the config's
_CLI_DEFAULTS = {"swa_lr": "--lr / 2", "swag_rank": "off", "ema_decay": "off"}
_OPTIONAL_GROUPS = ("swa", "swag", "ema", "privacy")


def config_options() -> list[Option]:
    """The options of TrainConfig and PrivacyConfig that ``ember train`` offers as flags."""
    from ember.train.config import train_options
    from ember.train.privacy_config import PrivacyConfig

    privacy = [dataclasses.replace(o, group="privacy")
               for o in options_of(PrivacyConfig, prefix="dp_")]
    return [o for o in [*train_options(), *privacy] if o.cli]


def _dest(opt: Option) -> str:
    return opt.flag.lstrip("-").replace("-", "_")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the config options, with their help and, where their group is always on,
    their defaults (an optional group's flags default to None: not given)."""
    types: dict[Rule, Any] = {Rule.INT_POSITIVE: int, Rule.INT_NONNEGATIVE: int}
    options = config_options()
    for title, groups in _FLAG_GROUPS:
        group = p.add_argument_group(title)
        for opt in (o for o in options if o.group in groups):
            off = opt.group in _OPTIONAL_GROUPS
            shown = _CLI_DEFAULTS.get(opt.name, "none" if opt.default is None else opt.default)
            kwargs: dict[str, Any] = {"dest": _dest(opt), "default": None if off else opt.default,
                                      "help": f"{opt.help} (default: {shown})".replace("%",
                                                                                        "%%")}
            if opt.rule is Rule.CHOICE:
                kwargs["choices"] = opt.choices
            else:
                kwargs["type"] = types.get(opt.rule, float)
                kwargs["metavar"] = opt.name.split("_")[-1].upper()
            group.add_argument(opt.flag, **kwargs)


class _Once(argparse.Action):
    """A shard-list flag given once: a second one would silently replace the first (several
    shards go in one quoted brace pattern)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice: name several shards with one quoted "
                         "brace pattern, such as 'shards/train-{000000..000009}.tar'")
        setattr(namespace, self.dest, values)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ember train`` to the ``ember`` command."""
    p = sub.add_parser(
        "train", help="train a classifier on your own image + cls shards",
        description="Train a small classifier on WebDataset-format image + class shards with "
        "ember.train: mixed precision, gradient accumulation and clipping, SWA/SWAG/EMA, DP-SGD "
        "through Opacus, exact checkpoint/resume, and DDP under torchrun.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True, metavar="URLS", action=_Once,
                      help="training shards: a brace pattern such as 'shards/train-{000000..000009}"
                      ".tar' (quote it), local paths, file:, http(s)://, s3://")
    data.add_argument("--eval-data", metavar="URLS", action=_Once,
                      help="test shards evaluated after every epoch (accuracy, NLL)")
    data.add_argument("--num-classes", type=int, default=None, metavar="N",
                      help="number of classes; labels in .cls must lie in [0, N) (default: the "
                      "number of names in the classes.json next to the --data shards)")
    data.add_argument("--grayscale", action="store_true",
                      help="decode images as 1-channel grayscale (default: RGB)")
    data.add_argument("--image-size", default=None, metavar="S|HxW",
                      help="train on S x S (or H x W) images: each image is scaled, aspect kept, "
                      "until it covers that size, then center-cropped (default: the size of the "
                      f"first image when neither side exceeds {_DEFAULT_MAX_SIDE}, else "
                      f"{_DEFAULT_MAX_SIDE})")
    data.add_argument("--skip-bad", action="store_true",
                      help="skip corrupt shards (their rest) and samples that do not decode, "
                      "counting them in the summary (default: stop with an error naming them)")
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
    model.add_argument("--batch-size", type=int, default=64, metavar="N",
                       help="micro-batch size per process (default: %(default)s)")
    model.add_argument("--lr", type=float, default=0.05,
                       help="SGD learning rate, constant until SWA (default: %(default)s)")
    model.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    model.add_argument("--weight-decay", type=float, default=5e-4,
                       help="SGD weight decay (default: %(default)s)")
    _add_config_flags(p)
    p.add_argument("--dp-noise-multiplier", type=float, default=None, help=argparse.SUPPRESS)
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
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights, the data shuffle and the run's ember.csprng "
                   "stream; -1 keys that stream from the OS. The DP-SGD noise is always keyed "
                   "from the OS, whatever the seed (default: %(default)s)")
    run_ = p.add_argument_group("outputs and resumption")
    run_.add_argument("--out", default="ember-train-out", metavar="DIR",
                      help="output directory (default: %(default)s)")
    run_.add_argument("--resume", default=None, metavar="PATH|auto",
                      help="continue from a checkpoint file or directory; 'auto' resumes from "
                      "DIR/checkpoints/last.pt if it exists")
    run_.add_argument("--force", action="store_true",
                      help="replace the run already in --out (its model.pt, swa.pt, ema.pt, "
                      "swag.pt, summary.json, metrics.jsonl and checkpoints/last.pt are moved "
                      "aside, put back if the new run fails, and deleted when it succeeds)")
    run_.add_argument("--keep-checkpoints", action="store_true",
                      help="keep checkpoints/last.pt after a successful DP-SGD run (it holds the "
                      "noise key: owner-only, never publish it; needed to continue the run with "
                      "more --epochs); by default it is removed")
    run_.add_argument("--no-progress", action="store_true", help="no progress bars")
    run_.add_argument("--swag-samples", type=int, default=None, metavar="S",
                      help="with --swag-rank: SWAG samples averaged to evaluate the posterior on "
                      "--eval-data (default: 20)")
    p.set_defaults(func=_main)


def _image_size(text: str | None) -> tuple[int, int] | None:
    """``--image-size``: ``S`` or ``HxW``."""
    if text is None or isinstance(text, tuple):
        return text
    parts = str(text).lower().split("x")
    try:
        sizes = [int(v) for v in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1 or max(sizes) > 65535:
        raise ConfigError(f"--image-size must be S or HxW, whole numbers in [1, 65535], got "
                          f"{text!r}")
    return (sizes[0], sizes[0]) if len(sizes) == 1 else (sizes[0], sizes[1])


# what ember.train's messages call the paths and loaders the command sets from its own flags
_OWN_NAMES = {"checkpoint_dir": "--out", "train_loader": "--data", "eval_loader": "--eval-data",
              "noise_multiplier": "--dp-noise-multiplier", "resume": "--resume", "seed": "--seed"}


def _flags() -> dict[str, str]:
    """Option name (as ember.train's messages write it) -> the flag that sets it."""
    out = {o.name if o.group != "privacy" else o.field: o.flag for o in config_options()}
    return {**out, **_OWN_NAMES}


def _in_flag_terms(message: str) -> str:
    """``message`` with the Python option names of ember.train replaced by the flags that set
    them: names with an underscore anywhere; plain words (``epochs``) where written ``name=``,
    or where they open the message (or a clause after ``: ``) as its subject."""
    def flag(m: re.Match) -> str:
        name, after = m.group(1), m.group(2)
        start = m.start() == 0 or message[max(0, m.start() - 2):m.start()] == ": "
        subject = start and re.match(r"(:|\s+(must|needs|is)\b)", message[m.end():]) is not None
        if "_" in name or after.startswith("=") or subject:
            return flags[name] + after
        return name + after

    flags = _flags()
    message = re.sub(r"TrainConfig\.|PrivacyConfig\.|\bprivacy (?=\w+ must)", "", message)
    names = "|".join(sorted(flags, key=len, reverse=True))
    flagged = re.sub(rf"(?<![\w-])({names})\b(=?)", lambda m: flag(m), message)
    return re.sub(r"\bprivacy (?=--)", "", flagged)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _error(message: str) -> int:
    print(f"ember train: error: {_one_line(message)}", file=sys.stderr)
    return 2


def _worker_cause(text: str) -> str:
    """The error itself where a DataLoader worker's exception carries its traceback (torch
    re-raises it as ``"Caught X in DataLoader worker process N. Original Traceback ..."``)."""
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return re.sub(r"^[\w.]+(Error|Exception): ", "", last.strip())


def _main(args: argparse.Namespace) -> int:
    """Run, turning bad input into one line ``ember train: error: ...`` and exit status 2: bad
    options and data locations (ConfigError), data that cannot be read (a ShardError names the
    shard, the sample and the cause), files that cannot be read or written (OSError)."""
    from ember.shards.errors import ShardError

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _notice  # one line each, in the command's voice
            return run(args)
    except (_Interrupted, KeyboardInterrupt) as exc:
        out = Path(getattr(args, "out", None) or ".")
        restored = isinstance(exc, _Interrupted) and exc.restored
        # the process is ending: DataLoader iterators whose workers the signal also stopped
        # would print "Exception ignored in ..." tracebacks when collected
        sys.unraisablehook = lambda unraisable: None
        print(_interrupted_message(out, restored, out / "checkpoints" / "last.pt"),
              file=sys.stderr)
        return exc.status if isinstance(exc, _Interrupted) else 130
    except ConfigError as exc:
        return _error(_in_flag_terms(str(exc)))
    except ShardError as exc:
        if "allow_pipe" in str(exc):  # a Python option: the command has no such flag
            return _error(f"{exc.url}: ember train does not run pipe: commands; write the "
                          "shards to files (or serve them over http) first")
        hint = "" if args.skip_bad else " (--skip-bad skips bad shards and samples)"
        return _error(f"cannot read the data: {_worker_cause(str(exc))}{hint}")
    except OSError as exc:
        return _error(str(exc))


def _notice(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            file: Any = None, line: str | None = None) -> None:
    """A warning as one line on stderr (no source line, no file name), from rank 0 only."""
    if not _is_main_rank():
        return
    print(f"ember train: warning: {_in_flag_terms(_one_line(str(message)))}", file=sys.stderr,
          flush=True)


def _check_args(args: argparse.Namespace) -> None:
    """The options on their own (before any data is looked at), each mistake one line in flag
    terms: bounds, the config options' own rules, what needs what, then the CLI's own options."""
    if isinstance(args.out, str):
        if not args.out.strip():
            raise ConfigError("--out must name a directory, got an empty string")
        args.out = Path(args.out)
    if args.swag_rank == 0:  # "0 collects SWA only", as before --swag-rank had no default
        args.swag_rank = None
    _check_limits(args)
    _check_floats(args)
    for opt in config_options():
        value = getattr(args, _dest(opt))
        wrong = violation(opt, value) if value is not None else None
        if wrong is not None:
            raise ConfigError(f"{opt.flag} {wrong}")
    _check_dependencies(args)
    _check_cli_options(args)


def _check_limits(args: argparse.Namespace) -> None:
    """Numbers too large to be meant (a typo) are refused before anything is allocated."""
    limits = {**_LIMITS, **{_dest(o): o.maximum for o in config_options()
                            if o.maximum is not None and o.rule is not Rule.POSITIVE}}
    for name, limit in limits.items():
        value = getattr(args, name, None)
        if value is not None and value > limit:
            shown = value if value < 10**15 else f"{str(value)[:6]}... ({len(str(value))} digits)"
            raise ConfigError(f"--{name.replace('_', '-')} must be <= {limit}, got {shown}")


def _float_flags() -> list[str]:
    """The float options whose value reaches the float32 model (not the DP budget's)."""
    generated = [_dest(o) for o in config_options() if o.group != "privacy"
                 and o.rule in (Rule.POSITIVE, Rule.NONNEGATIVE, Rule.FRACTION)]
    return ["lr", "momentum", "weight_decay", "swap_lr", *generated]


def _check_floats(args: argparse.Namespace) -> None:
    for name in [*_float_flags(), "dp_epsilon", "dp_delta", "max_grad_norm", "dp_max_epsilon"]:
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = f"--{name.replace('_', '-')}"
        if not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")
        if not name.startswith("dp_") and name != "max_grad_norm" and abs(value) > _FLOAT32_MAX:
            # the model trains in float32: torch cannot turn a larger factor into one
            raise ConfigError(f"{flag} must be at most {_FLOAT32_MAX:.3g} (float32's largest "
                              f"number), got {value:g}")
        if name in ("lr", "swa_lr", "swap_lr", "swa_lr_max") and 0 < value < _FLOAT32_TINY:
            raise ConfigError(f"{flag} {value:g} is 0 in float32, in which the model trains (the "
                              f"smallest rate is {_FLOAT32_TINY:.3g})")


# an optional group's switch flags (all needed together) and what it says it is for
_SWITCHES = {"swa": (("--swa-start",), "(the epoch where averaging starts)"),
             "swag": (("--swag-rank",), "(the SWAG posterior's rank)"),
             "ema": (("--ema-decay",), "(the EMA's decay)"),
             "privacy": (("--dp-epsilon", "--dp-delta", "--max-grad-norm"), "")}


def _check_dependencies(args: argparse.Namespace) -> None:
    """Options of an optional group need its switch (``--swa-lr`` needs ``--swa-start``); SWAG
    is collected in the SWA phase; DP-SGD needs its three settings together."""
    given = {o.flag: o for o in config_options() if getattr(args, _dest(o)) is not None}
    dp = _SWITCHES["privacy"][0]
    if any(f in given for f in dp) and not all(f in given for f in dp):
        raise ConfigError("DP-SGD needs all of --dp-epsilon, --dp-delta and --max-grad-norm")
    for flag, opt in given.items():
        switches, why = _SWITCHES.get(opt.group, ((), ""))
        if opt.group == "privacy" and flag not in switches and not all(f in given for f in dp):
            raise ConfigError(f"{flag} is for DP-SGD runs (--dp-epsilon, --dp-delta, "
                              "--max-grad-norm)")
        if opt.group == "swag" and "--swa-start" not in given:
            raise ConfigError(f"{flag} needs --swa-start (the epoch where averaging starts)")
        if switches and flag not in switches and not all(f in given for f in switches):
            raise ConfigError(f"{flag} needs {switches[0]} {why}".strip())


def _check_cli_options(args: argparse.Namespace) -> None:
    """The options that are the command's own (the model, the reading, SWAP, outputs)."""
    for name in ("hidden", "batch_size"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.num_classes is not None and args.num_classes < 2:
        raise ConfigError(f"--num-classes must be >= 2, got {args.num_classes}")
    if args.shuffle_buffer < 0 or args.workers < 0:
        raise ConfigError("--shuffle-buffer and --workers must be >= 0")
    if not (args.seed == -1 or 0 <= args.seed < 2**63):
        raise ConfigError(f"--seed must be -1 or in [0, 2**63), got {args.seed}")
    if args.ray_address is not None and args.workers:
        raise ConfigError("--workers applies to local reading; with --ray-address the Ray "
                          "cluster's CPUs read the shards (drop --workers)")
    _check_optimizer_options(args)
    if args.dp_noise_multiplier is not None:
        raise ConfigError("--dp-noise-multiplier was removed (it was not differential privacy); "
                          "use --dp-epsilon E --dp-delta D --max-grad-norm C")
    if args.dp_epsilon is not None and args.clip_grad_norm is not None:
        raise ConfigError("--clip-grad-norm does not apply to DP-SGD, which clips each example "
                          "to --max-grad-norm")
    if args.keep_checkpoints and args.dp_epsilon is None:
        raise ConfigError("--keep-checkpoints is for DP-SGD runs (--dp-epsilon); other runs "
                          "always keep their checkpoints")
    if args.swag_samples is not None and args.swag_rank is None:
        raise ConfigError("--swag-samples needs --swag-rank (the SWAG posterior it samples)")
    if args.swag_samples is not None and args.swag_samples < 1:
        raise ConfigError(f"--swag-samples must be >= 1, got {args.swag_samples}")
    _check_dp_combination(args)
    _check_swap(args)


def _check_optimizer_options(args: argparse.Namespace) -> None:
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    if args.momentum < 0 or args.weight_decay < 0:
        raise ConfigError(f"--momentum and --weight-decay must be >= 0, got {args.momentum} and "
                          f"{args.weight_decay}")


def _check_dp_combination(args: argparse.Namespace) -> None:
    """What DP-SGD cannot honour, in the command's terms."""
    if args.dp_epsilon is None:
        return
    if args.accumulate != 1:
        raise ConfigError("--accumulate does not apply to DP-SGD: each Poisson-sampled batch is "
                          "one step of the accountant (bound memory with "
                          "--dp-max-physical-batch-size)")
    if args.checkpoint_every is not None:
        raise ConfigError("--checkpoint-every does not apply to DP-SGD: a private run is "
                          "checkpointed at epoch ends only")
    if args.precision != "fp32":
        raise ConfigError(f"--precision {args.precision} does not apply to DP-SGD, which trains "
                          "in fp32")


def _check_swap(args: argparse.Namespace) -> None:
    if args.swap_phase2_epochs is None:
        if (args.swap_batch_size, args.swap_lr) != (None, None):
            raise ConfigError("--swap-batch-size and --swap-lr need --swap-phase2-epochs")
        return
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


def _configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The TrainConfig and PrivacyConfig (None without DP-SGD) the flags describe."""
    from ember.train.config import (
        CheckpointConfig,
        EMAConfig,
        LogConfig,
        StepConfig,
        SWAConfig,
        SWAGConfig,
        TrainConfig,
    )
    from ember.train.privacy_config import PrivacyConfig

    groups: dict[str, dict[str, Any]] = {g: {} for g in ("", "step", "schedule", "swa", "swag",
                                                         "ema", "checkpoint", "privacy")}
    for opt in config_options():
        value = getattr(args, _dest(opt))
        if value is not None:
            groups[opt.group][opt.field] = value
    swa = groups["swa"]
    if swa:
        swa.setdefault("lr", args.lr / 2)
    config = TrainConfig(
        epochs=args.epochs, seed=None if args.seed == -1 else args.seed,
        step=StepConfig(**groups["step"]), swa=SWAConfig(**swa) if swa else None,
        swag=SWAGConfig(**groups["swag"]) if groups["swag"] else None,
        ema=EMAConfig(**groups["ema"]) if groups["ema"] else None,
        checkpoint=CheckpointConfig(dir=args.out / "checkpoints", every=args.checkpoint_every,
                                    resume=args.resume),
        log=LogConfig(metrics_path=args.out / "metrics.jsonl", progress=not args.no_progress))
    config.check()
    privacy = PrivacyConfig(**groups["privacy"]) if groups["privacy"] else None
    if privacy is not None:
        privacy.check()
    return config, privacy


def _in_memory_loader(stream: Any, batch_size: int, world: Any) -> torch.utils.data.DataLoader:
    """The whole training stream as a map-style DataLoader: DP-SGD's Poisson sampling picks
    examples by index, so the shards are read into memory once (by every rank, which samples
    its share; --batch-size stays per process)."""
    import torch

    xs, ys = [], []
    for x, y in stream:
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ConfigError("--data holds no samples")
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    sampler: Any = torch.utils.data.DistributedSampler(data, world.size, world.rank,
                                                       shuffle=False) \
        if world.distributed else None
    return torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler)


def _swap_phases(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Any, test: Any, world: Any) -> dict:
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
                               num_workers=args.workers, split_ranks=False,
                               image_size=args.image_size, skip_bad=args.skip_bad)
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


def _is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class _OutGuard:
    """What a run does to --out, undone where it fails: with --force the earlier run's files are
    moved aside and put back if the new run fails, and deleted once it succeeds; a new run that
    fails before its first checkpoint leaves no files (nor folders it made) that would block the
    same command. Only the main rank touches files."""

    def __init__(self, out: Path, fresh: bool, main: bool) -> None:
        self.out, self.fresh, self.main = out, fresh, main
        self.made: list[Path] = []  # folders this run created, innermost last
        self.aside: Path | None = None
        self.moved: list[str] = []

    def move_aside(self, names: list[str]) -> None:
        self.aside = self.out / f".ember-replaced-{os.getpid()}"
        for name in names:
            target = self.aside / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.out / name, target)
            self.moved.append(name)

    def failed(self) -> None:
        if not self.main:
            return
        # nothing may stop the restore half way: a second Ctrl-C or SIGTERM is held back, and
        # torch's SIGCHLD handler (which raises once a DataLoader worker has died) is paused
        with _signals_held():
            checkpoint = self.out / "checkpoints" / "last.pt"
            if self.aside is not None or (self.fresh and not checkpoint.exists()):
                for name in _RUN_FILES:  # this run's files: nothing of them is worth keeping
                    _persist(functools.partial((self.out / name).unlink, missing_ok=True))
                    _persist(functools.partial((self.out / (name + ".writing")).unlink,
                                               missing_ok=True))
            if self.aside is not None:
                for name in self.moved:
                    _persist(functools.partial(os.replace, self.aside / name, self.out / name))
                import shutil

                shutil.rmtree(self.aside, ignore_errors=True)
            for folder in reversed(self.made):
                with contextlib.suppress(OSError):  # not empty: keep it
                    folder.rmdir()

    def succeeded(self) -> None:
        if self.main and self.aside is not None:
            import shutil

            shutil.rmtree(self.aside, ignore_errors=True)


def _persist(step: Callable[[], object], tries: int = 3) -> None:
    """Run one step of putting --out back, trying again after an exception that interrupted it
    (an OSError that stays is given up: the step's file is then left where it is)."""
    for attempt in range(tries):
        try:
            step()
            return
        except BaseException:  # noqa: BLE001 - a restore must finish whatever interrupted it
            if attempt == tries - 1:
                return


@contextlib.contextmanager
def _signals_held():
    """SIGINT, SIGTERM and SIGHUP ignored and SIGCHLD at its default while the block runs (in
    the main thread; elsewhere nothing changes): the run is ending already."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    changes = {n: signal.SIG_IGN for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)}
    if hasattr(signal, "SIGCHLD"):
        changes["SIGCHLD"] = signal.SIG_DFL
    previous = {}
    try:
        for n, action in changes.items():
            previous[n] = signal.signal(getattr(signal, n), action)
        yield
    finally:
        for n, old in previous.items():
            signal.signal(getattr(signal, n), old if old is not None else signal.SIG_DFL)


def _prepare_out(out: Path, resume: str | None, force: bool) -> _OutGuard:
    """Refuse to replace a run already in ``out`` (unless resuming it or forced), and check that
    ``out`` can be written before any training is done."""
    existing = [name for name in _RUN_FILES if (out / name).exists()]
    if existing and resume is None and not force:
        raise ConfigError(f"--out {out} already holds a run ({', '.join(existing)}); pass "
                          "--resume auto to continue it (a finished run only with a larger "
                          "--epochs), --force to replace it, or another --out")
    guard = _OutGuard(out, fresh=resume is None, main=_is_main_rank())
    try:
        for folder in (out, out / "checkpoints"):
            if not folder.exists():
                folder.mkdir(parents=True, exist_ok=True)
                guard.made.append(folder)
        probe = out / f".ember-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        if existing and resume is None and guard.main:
            guard.move_aside(existing)
    except OSError as exc:
        guard.failed()
        reason = exc.strerror or str(exc)
        raise ConfigError(f"--out {out}: cannot write there ({reason})") from None
    return guard


def _class_names(args: argparse.Namespace) -> list[str] | None:
    """The class names of classes.json next to --data; sets --num-classes from them if unset."""
    from ember.train.data import read_class_names

    try:
        names = read_class_names(args.data)
    except ConfigError as exc:
        raise ConfigError(f"--data: {exc}") from None
    if args.eval_data:
        try:
            eval_names = read_class_names(args.eval_data)
        except ConfigError as exc:
            raise ConfigError(f"--eval-data: {exc}") from None
        if eval_names is not None and names is not None and eval_names != names:
            raise ConfigError(f"the classes.json next to --eval-data names other classes than "
                              f"the one next to --data ({', '.join(eval_names[:4])}"
                              f"{', ...' if len(eval_names) > 4 else ''} against "
                              f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): the "
                              "labels would not mean the same; write both with one `ember "
                              "shards create` class list")
    if names is None:
        if args.num_classes is None:
            raise ConfigError("--num-classes is needed: there is no classes.json next to the "
                              "--data shards (`ember shards create` writes one)")
        return None
    if len(names) < 2:
        raise ConfigError(f"the classes.json next to --data names {len(names)} class(es); "
                          "training needs at least 2")
    if args.num_classes is None:
        args.num_classes = len(names)
    elif args.num_classes != len(names):
        raise ConfigError(f"--num-classes {args.num_classes} disagrees with the {len(names)} "
                          "classes named in the classes.json next to --data")
    return names


def _batches_per_epoch(urls: list[str], batch_size: int, workers: int, skip_bad: bool
                       ) -> int | None:
    """Batches of one epoch of one process, where the shards are local (an .idx file or a header
    scan counts their samples) and read by at most one worker; None otherwise (several workers
    each end with a partial batch of their own shards, which change from epoch to epoch; a bad
    shard that --skip-bad skips has no known count)."""
    from ember.shards.errors import ShardError
    from ember.shards.index import sample_count
    from ember.shards.urls import local_path

    if (int(os.environ.get("WORLD_SIZE", "1")) > 1 or workers > 1
            or any(local_path(u) is None for u in urls)):
        return None
    try:
        total = sum(sample_count(u) for u in urls)
    except ShardError:
        if skip_bad:
            return None
        raise
    return -(-total // batch_size)


def _per_class_accuracy(model: nn.Module, loader: Any, names: list[str]) -> dict[str, float]:
    from ember.train.loop import predict

    probs, targets = predict(model, loader)
    hits = probs.argmax(1) == targets
    out = {}
    for i, name in enumerate(names):
        mask = targets == i
        if bool(mask.any()):
            out[name] = float(hits[mask].float().mean())
    return out


def _dispose_private_checkpoint(path: Path | None, keep: bool) -> None:
    """A DP run's checkpoint holds its noise key: remove it after success unless kept, and say
    so either way."""
    if path is None or not path.exists():
        return
    if keep:
        print(f"{path} holds the DP noise key (anyone with it can strip the noise): it is "
              f"owner-only; keep it private and do not publish it with the model")
        return
    path.unlink()
    path.with_name(path.name + ".writing").unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: leave it
        path.parent.rmdir()
    print(f"removed {path}: it held the DP noise key (pass --keep-checkpoints to keep it for "
          f"resuming; never publish it with the model)")


class _Diverged(Exception):
    """The training loss stopped being finite."""


def _check_model_size(args: argparse.Namespace, shape: tuple[int, ...]) -> None:
    """Refuse a model or a batch too large to be meant, before anything is allocated."""
    pixels = 1
    for d in shape:
        pixels *= d
    h = args.hidden
    if args.model == "mlp":
        params = pixels * h + h + h * h + h + h * args.num_classes + args.num_classes
    else:
        params = shape[0] * 32 * 9 + 32 + 32 * 64 * 9 + 64 + 64 * h + h + h * args.num_classes
    if params > _MAX_PARAMETERS:
        raise ConfigError(f"the {args.model} for {shape[1]}x{shape[2]} images with --hidden {h} "
                          f"would have {params:,} parameters (more than {_MAX_PARAMETERS:,}); "
                          "pass a smaller --image-size or --hidden, or --model cnn")
    _check_batch_bytes(args, shape)


def _check_batch_bytes(args: argparse.Namespace, shape: tuple[int, ...]) -> None:
    pixels = shape[0] * shape[1] * shape[2]
    batch_bytes = 4 * pixels * args.batch_size
    if batch_bytes > _MAX_BATCH_BYTES:
        raise ConfigError(f"a batch of --batch-size {args.batch_size} images of "
                          f"{shape[1]}x{shape[2]} would take {batch_bytes / 2**30:.0f} GiB; pass "
                          "a smaller --image-size or --batch-size")


def _check_resume(args: argparse.Namespace, model: nn.Module) -> None:
    """The checkpoint --resume names must fit this run's model and still have epochs to do."""
    from ember.train.checkpoint import find_checkpoint, load_checkpoint

    path = find_checkpoint(args.resume, args.out / "checkpoints")
    if path is None:  # --resume auto without a checkpoint: a fresh start
        return
    try:
        state = load_checkpoint(path)
    except ConfigError as exc:
        if "is not an ember.train checkpoint" not in str(exc):
            raise
        raise ConfigError(f"--resume {path}: not an ember checkpoint (ember train writes them "
                          "to --out/checkpoints/last.pt)") from None
    saved, mine = state.get("model", {}), model.state_dict()
    if set(saved) != set(mine) or any(tuple(saved[k].shape) != tuple(v.shape)
                                      for k, v in mine.items()):
        raise ConfigError(f"--resume {path}: the checkpoint's model differs from this run's "
                          f"(--model {args.model}, --hidden {args.hidden}, --image-size "
                          f"{args.image_size[0]}x{args.image_size[1]}, --grayscale "
                          f"{'on' if args.grayscale else 'off'}, {args.num_classes} classes); "
                          "pass the options of the run that wrote it")
    if (state.get("privacy") is not None) != (args.dp_epsilon is not None):
        had = "with" if state.get("privacy") is not None else "without"
        raise ConfigError(f"--resume {path}: that run was trained {had} DP-SGD; resume it "
                          f"{had} --dp-epsilon/--dp-delta/--max-grad-norm, or start a new run "
                          "in another --out")
    done = int(state.get("progress", {}).get("epoch", 0))
    if done >= args.epochs:
        raise ConfigError(f"--resume {path}: that run already finished {done} of --epochs "
                          f"{args.epochs}; pass a larger --epochs to train on")


def run(args: argparse.Namespace) -> int:
    """Train as the parsed ``ember train`` arguments say; returns the exit status."""
    from ember.train.data import check_shards

    _check_args(args)
    if args.resume not in (None, "auto") and (Path(args.resume) / "checkpoints" / "last.pt").is_file():
        args.resume = str(Path(args.resume) / "checkpoints" / "last.pt")  # a run's --out folder
    args.image_size = _image_size(args.image_size)
    if args.image_size is not None:  # before any image is resized to it
        _check_batch_bytes(args, (1 if args.grayscale else 3, *args.image_size))
    config, privacy = _configs(args)
    urls = check_shards(args.data, "--data")
    if args.eval_data:
        check_shards(args.eval_data, "--eval-data")
    names = _class_names(args)
    previous = _check_existing_run(args, privacy is not None)
    guard = _prepare_out(args.out, args.resume, args.force)
    try:
        with _signals_as_interrupts():
            status = _train(args, urls, names, config, privacy, previous)
    except (KeyboardInterrupt, _Terminated) as exc:
        guard.failed()
        code = 128 + exc.signum if isinstance(exc, _Terminated) else 130
        raise _Interrupted(code, restored=guard.aside is not None) from None
    except BaseException:
        guard.failed()
        raise
    guard.succeeded()
    return status


def _previous_summary(out: Path) -> dict[str, Any] | None:
    """The summary.json of the run in ``out``, if there is a readable one."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def _check_existing_run(args: argparse.Namespace, private: bool) -> dict[str, Any] | None:
    """A finished run in --out is continued only when asked for more epochs, and a private one
    only from its checkpoint (its accountant composes every step; it is never restarted).
    Returns the earlier run's summary (None if there is none)."""
    summary = _previous_summary(args.out)
    if summary is None or args.resume is None:
        return summary
    done = int(summary.get("epochs_done", summary.get("epochs", 0)) or 0)
    if not summary.get("finished", True):
        return summary
    if args.epochs <= done:
        raise ConfigError(f"--resume {args.resume}: the run in {args.out} already finished "
                          f"{done} of --epochs {done}; pass a larger --epochs to train on, "
                          "--force to replace it, or another --out")
    checkpoint = args.out / "checkpoints" / "last.pt"
    if args.resume == "auto" and not checkpoint.exists():
        was_private = summary.get("privacy") is not None
        why = ("its checkpoint, which held the DP noise key, was removed: continuing would "
               "restart its privacy accountant" if was_private else "its checkpoint is gone")
        raise ConfigError(f"--resume auto: the run in {args.out} finished {done} epochs and "
                          f"{why}; start a new run in another --out"
                          + (f" (its epsilon adds to the {summary['privacy']['epsilon']:.4g} "
                             "already spent on this data)" if was_private else "")
                          + (", and pass --keep-checkpoints to DP-SGD runs you mean to continue"
                             if was_private else ""))
    return summary


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (a scheduler's time limit, ``timeout``, a closed terminal):
    handled like Ctrl-C, so --force puts the earlier run back."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Interrupted(Exception):
    """The run ended by Ctrl-C or a termination signal, after --out was put in order."""

    def __init__(self, status: int, restored: bool) -> None:
        super().__init__(status)
        self.status, self.restored = status, restored


@contextlib.contextmanager
def _signals_as_interrupts():
    """SIGTERM (and SIGHUP where there is one) raise _Terminated in the main thread while the run
    lasts; elsewhere (another thread) nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signum)

    names = [n for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    previous = {n: signal.signal(getattr(signal, n), handler) for n in names}
    try:
        yield
    finally:
        for n, old in previous.items():
            signal.signal(getattr(signal, n), old)


def _interrupted_message(out: Path, restored: bool, checkpoint: Path | None = None) -> str:
    """The one line for a run ended by Ctrl-C or a termination signal."""
    if restored:
        return (f"ember train: interrupted; the earlier run in {out} is back as it was (--force "
                "replaces it only when the new run finishes), and this run was discarded")
    if checkpoint is not None and checkpoint.exists():
        return f"ember train: interrupted; continue with --resume auto from {checkpoint}"
    return "ember train: interrupted before its first checkpoint; nothing to resume"


def _train(args: argparse.Namespace, urls: list[str], names: list[str] | None, config: Any,
           privacy: Any, previous: dict[str, Any] | None) -> int:
    """The run after its options, data locations and --out were checked."""
    import torch

    from ember.train.distributed import init_from_env, shutdown

    world = init_from_env()  # before building loaders, so each rank reads its own shards
    try:
        if args.swap_phase2_epochs is not None and not world.distributed:
            raise ConfigError("SWAP (--swap-phase2-epochs) needs at least 2 processes, got a "
                              "world size of 1: run under torchrun --nproc_per_node=N with N >= 2")
        torch.manual_seed(max(args.seed, 0))  # the same initial weights on every rank
        model = _build_model(args, world)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                    weight_decay=args.weight_decay)
        skips = _skip_log(args)
        train, test = _loaders(args, urls, world, privacy, skips)
        result, swap_record, streams = _fit(args, model, optimizer, train, test, config,
                                            privacy, world)
    finally:
        shutdown(world)
    if world.is_main:
        _write_outputs(args, result, names, test, swap_record, streams, skips, previous,
                       privacy)
    return 0


def _build_model(args: argparse.Namespace, world: Any) -> nn.Module:
    """The model for the images' shape (``--image-size``, or the first image's, said so)."""
    from ember.train.data import peek_image_shape

    shape = peek_image_shape(args.data, grayscale=args.grayscale, image_size=args.image_size,
                             skip_bad=args.skip_bad)
    if args.image_size is None:  # the first image's size: images of other sizes are fitted to it
        how = "the first image's size"
        if max(shape[1:]) > _DEFAULT_MAX_SIDE:
            how = (f"the first image is {shape[1]}x{shape[2]} (height x width), larger than "
                   f"{_DEFAULT_MAX_SIDE}: each image is scaled and center-cropped")
            shape = (shape[0], _DEFAULT_MAX_SIDE, _DEFAULT_MAX_SIDE)
        if world.is_main:
            print(f"training on {shape[1]}x{shape[2]} images ({how}; --image-size sets another "
                  "size)", flush=True)
        args.image_size = tuple(shape[1:])
    _check_model_size(args, shape)
    model = build_model(args.model, shape, args.num_classes, args.hidden)
    if args.resume is not None:
        _check_resume(args, model)
    return model


def _skip_log(args: argparse.Namespace) -> Any:
    """Under --skip-bad, where each skipped shard rest or sample is noted (one file in --out,
    read into summary.json and removed at the end)."""
    from ember.train.data import SkipLog

    if not args.skip_bad:
        return None
    path = args.out / f".skipped-{os.getpid()}.jsonl"
    path.unlink(missing_ok=True)
    return SkipLog(path)


def _loaders(args: argparse.Namespace, urls: list[str], world: Any, privacy: Any,
             skips: Any) -> tuple[Any, Any]:
    """The training loader (shards streamed, Ray-read, or in memory for DP-SGD's Poisson
    sampling) and the evaluation loader (None without --eval-data)."""
    from ember.train.data import SkipLog, image_class_loader

    skip = skips or False
    skip_eval = SkipLog(skips.path, "evaluation") if skips is not None else False
    _fit_workers(args, urls, world)
    # torch says the same in several lines, once per DataLoader
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if privacy is not None and args.ray_address is not None:
        raise ConfigError("--ray-address cannot be combined with --dp-epsilon: DP-SGD samples "
                          "every batch from all examples held in memory")
    train: Any
    if privacy is not None:  # all of --data on every rank, in shard order
        train = _in_memory_loader(image_class_loader(
            args.data, args.batch_size, shuffle=0, grayscale=args.grayscale,
            num_workers=args.workers, split_ranks=False, image_size=args.image_size,
            skip_bad=skip, num_classes=args.num_classes), args.batch_size, world)
    else:
        train = image_class_loader(args.data, args.batch_size, seed=max(args.seed, 0),
                                   shuffle=args.shuffle_buffer, grayscale=args.grayscale,
                                   num_workers=args.workers, ray_address=args.ray_address,
                                   image_size=args.image_size, skip_bad=skip,
                                   num_classes=args.num_classes)
        train = _with_length_or_cluster(args, urls, train)
    test = None
    if args.eval_data:
        test = image_class_loader(args.eval_data, 256, shuffle=0, grayscale=args.grayscale,
                                  split_ranks=False, image_size=args.image_size,
                                  skip_bad=skip_eval, num_classes=args.num_classes)
    return train, test


def _fit_workers(args: argparse.Namespace, urls: list[str], world: Any) -> None:
    """Fewer workers than asked where there are too few shards (each reads whole shards)."""
    if args.workers > 1 and args.ray_address is None and len(urls) < world.size * args.workers:
        workers = max(1, len(urls) // world.size)
        if world.is_main:
            print(f"--workers {args.workers} but only {len(urls)} shard(s) for {world.size} "
                  f"process(es): reading with {workers} worker(s) per process (each worker reads "
                  "whole shards)", flush=True)
        args.workers = workers
    cpus = os.cpu_count() or 1
    if args.workers > cpus and world.is_main:
        print(f"--workers {args.workers} is more than the {cpus} CPUs here: more workers than "
              "CPUs only help when reading waits on the network", flush=True)


def _with_length_or_cluster(args: argparse.Namespace, urls: list[str], train: Any) -> Any:
    if args.ray_address is not None:
        try:
            train.connect()
        except (ImportError, ConnectionError) as exc:
            raise ConfigError(f"--ray-address: {exc}") from None
    elif not args.no_progress:
        batches = _batches_per_epoch(urls, args.batch_size, args.workers, args.skip_bad)
        if batches is not None:  # the progress bar's total
            train = train.with_length(batches)
    return train


class _LabelCheckedLoss:
    """Cross-entropy that refuses labels outside [0, --num-classes) and stops a run whose loss
    stays non-finite (fp16's scaler skips overflowing steps by itself: only when it persists)."""

    def __init__(self, num_classes: int, precision: str) -> None:
        self.num_classes, self.precision = num_classes, precision
        self.nonfinite = 0  # consecutive steps with a non-finite loss

    def __call__(self, logits: Any, target: Any) -> Any:
        import torch
        from torch import nn

        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= self.num_classes):
            raise ConfigError(f"a .cls label is outside [0, --num-classes={self.num_classes}): "
                              f"got labels in [{int(target.min())}, {int(target.max())}]")
        loss = nn.functional.cross_entropy(logits, target)
        if bool(torch.isfinite(loss.detach())):
            self.nonfinite = 0
        else:
            self.nonfinite += 1
            if self.precision != "fp16" or self.nonfinite >= 20:
                raise _Diverged()
        return loss


class _EpsilonPrinter:
    """A callback printing each epoch's epsilon (rank 0)."""

    def __init__(self, epochs: int, main: bool) -> None:
        self.epochs, self.main = epochs, main

    def on_epoch_end(self, epoch: int, record: dict) -> None:
        if self.main and "epsilon" in record:
            print(f"epoch {epoch + 1}/{self.epochs}: epsilon {record['epsilon']:.4f} "
                  f"(delta {record['dp_delta']:g}, {record['dp_steps']} steps)", flush=True)


def _fit(args: argparse.Namespace, model: nn.Module, optimizer: Any, train: Any, test: Any,
         config: Any, privacy: Any, world: Any) -> tuple[Any, Any, list[str]]:
    """fit, with its failures in the command's terms; then SWAP's phases if asked."""
    from ember.train.distributed import all_gather_objects
    from ember.train.loop import fit
    from ember.train.privacy import EpsilonTooLowError

    loss_fn = _LabelCheckedLoss(args.num_classes, args.precision)
    try:
        result = fit(model, optimizer, train, config, loss_fn=loss_fn, eval_loader=test,
                     privacy=privacy, callbacks=[_EpsilonPrinter(args.epochs, world.is_main)])
    except _Diverged:
        last = args.out / "checkpoints" / "last.pt"
        kept = f"; the last checkpoint before it is {last}" if last.exists() else ""
        raise ConfigError(f"the training loss became inf or nan (--lr {args.lr:g} is too "
                          f"large for this model and data, or the data hold extreme values); "
                          f"lower --lr{kept}") from None
    except EpsilonTooLowError as exc:
        raise ConfigError(f"--dp-epsilon {args.dp_epsilon:g} is too low: with --dp-delta "
                          f"{args.dp_delta:g} over {exc.steps} steps (--epochs {args.epochs} "
                          f"at sample rate {exc.sample_rate:.4g}) no noise multiplier "
                          f"reaches it; raise --dp-epsilon or --dp-delta, or lower "
                          f"--epochs") from None
    swap_record = _swap_phases(args, result.model, optimizer, loss_fn, test, world) \
        if args.swap_phase2_epochs is not None else None
    streams = all_gather_objects(
        hashlib.sha256(bytes(result.generator.get_state().numpy())).hexdigest()[:16], world)
    return result, swap_record, streams


def _swag_summary(args: argparse.Namespace, result: Any, test: Any) -> dict[str, Any]:
    """Save the SWAG posterior (swag.pt) and, with --eval-data, its Bayesian model average's
    accuracy and NLL over --swag-samples samples."""
    import copy

    import torch

    from ember.swa import accuracy, bayesian_average, nll
    from ember.train.inference import predict

    swag = result.swag
    torch.save(swag.state_dict(), args.out / "swag.pt")
    out: dict[str, Any] = {"rank": swag.max_rank, "collected": swag.n_collected}
    if test is None or swag.n_collected < 2:
        return out
    _, targets = predict(result.model, test)
    generator = torch.Generator().manual_seed(max(args.seed, 0))
    samples = args.swag_samples or 20
    probs = bayesian_average(copy.deepcopy(result.model), swag, test, samples,
                             generator=generator, forward=lambda m, batch: m(batch[0]))
    out.update({"samples": samples, "eval_accuracy": accuracy(probs, targets),
                "eval_nll": nll(probs, targets)})
    return out


def _write_outputs(args: argparse.Namespace, result: Any, names: list[str] | None, test: Any,
                   swap_record: Any, streams: list[str], skips: Any,
                   previous: dict[str, Any] | None, privacy: Any) -> None:
    """model.pt, swa.pt, swag.pt, summary.json and the closing lines (rank 0)."""
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result.model.state_dict(), args.out / "model.pt")
    if result.swa is not None:
        torch.save(result.swa.module.state_dict(), args.out / "swa.pt")
    if result.ema is not None:
        torch.save(result.ema.module.state_dict(), args.out / "ema.pt")
    summary = _summary(args, result, names, streams)
    if result.swag is not None:
        summary["swag"] = _swag_summary(args, result, test)
    if test is not None and names is not None:
        summary["eval_accuracy_per_class"] = _per_class_accuracy(result.model, test, names)
    if skips is not None:  # after every pass over the data
        summary["skipped_bad_items"] = skips.read()
        Path(skips.path).unlink(missing_ok=True)
    if swap_record is not None:
        summary["swap"] = swap_record
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _print_closing(args, result, summary, names, privacy, previous)
    if privacy is not None:
        _dispose_private_checkpoint(result.checkpoint, args.keep_checkpoints)
    print(f"outputs in {args.out}")


def _summary(args: argparse.Namespace, result: Any, names: list[str] | None,
             streams: list[str]) -> dict[str, Any]:
    skipped = sum(r.get("data_errors", 0) for r in result.history)
    skipped_eval = result.history[-1].get("eval_data_errors", 0) if result.history else 0
    summary = {"steps": result.steps, "skipped_steps": result.skipped_steps,
               "empty_steps": result.empty_steps,
               "dropped_microbatches": result.dropped_microbatches,
               "world_size": result.world_size, "rank_digests": result.rank_digests,
               "ranks_in_sync": len(set(result.rank_digests)) == 1,
               "rank_streams": streams, "history": result.history,
               "epochs": args.epochs, "epochs_done": len(result.history) and
               result.history[-1]["epoch"] + 1, "finished": True,
               "stopped_early": result.stopped_early, "data": args.data,
               "epsilon": result.epsilon, "noise_multiplier": result.noise_multiplier,
               "privacy": result.privacy,
               "image_size": list(args.image_size), "classes": names,
               "skipped_bad": skipped, "skipped_bad_eval": skipped_eval}
    return summary


def _print_closing(args: argparse.Namespace, result: Any, summary: dict[str, Any],
                   names: list[str] | None, privacy: Any, previous: dict[str, Any] | None) -> None:
    last = result.history[-1] if result.history else {}
    loss = last.get("train_loss")
    print(f"trained {result.steps} steps on {result.world_size} process(es); final train loss "
          f"{float('nan') if loss is None else loss:.4f}"
          + (" (not covered by epsilon)" if privacy is not None else "")
          + (f", test accuracy {last['eval_accuracy']:.4f}" if "eval_accuracy" in last else ""))
    if names is not None:
        print(f"classes: {', '.join(f'{i}={n}' for i, n in enumerate(names))}")
    per_class = summary.get("eval_accuracy_per_class")
    if per_class:
        print("test accuracy per class: "
              + ", ".join(f"{n} {a:.4f}" for n, a in per_class.items()))
    if "eval_accuracy" in summary.get("swag", {}):
        print(f"SWAG ({summary['swag']['samples']} samples): test accuracy "
              f"{summary['swag']['eval_accuracy']:.4f}, NLL {summary['swag']['eval_nll']:.4f}")
    if args.skip_bad:
        _print_skipped(args, summary)
    swap_record = summary.get("swap")
    if "eval_swa_accuracy" in last:
        print(f"SWA: test accuracy {last['eval_swa_accuracy']:.4f}")
    if swap_record is not None and "eval_accuracy" in swap_record:
        print(f"SWAP average of {result.world_size} ranks: test accuracy "
              f"{swap_record['eval_accuracy']:.4f}")
    if privacy is not None and previous is not None and previous.get("privacy") \
            and args.resume is None and previous.get("data") == args.data:
        print(f"note: the run this one replaced in {args.out} spent epsilon "
              f"{previous['privacy']['epsilon']:.4g} on the same --data; privacy budgets of runs "
              "on the same data add up")


def _print_skipped(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print(f"skipped {summary['skipped_bad']} bad shards/samples in training"
          + (f" and {summary['skipped_bad_eval']} in each pass over --eval-data"
             if args.eval_data else "") + " (--skip-bad)")
    seen = set()
    for item in summary.get("skipped_bad_items", []):
        where = " ".join(str(v) for v in (item.get("shard"), item.get("key")) if v)
        line = f"  skipped {where or 'a sample'}: {item.get('cause')}"
        if line not in seen:  # each pass over the data skips it again
            seen.add(line)
            print(line)
