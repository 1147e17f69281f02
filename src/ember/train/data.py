"""Image-classification data from WebDataset shards: an image member plus a ``.cls`` label.

The convention is webdataset's: each sample has one image (``png``, ``jpg``, ``jpeg``, ``ppm``,
``pgm``, ``webp`` ...) and an integer class in ``cls``. Images are decoded to float tensors in
[0, 1] of shape ``(channels, height, width)``; with ``image_size`` every image is first resized
(shorter side) and center-cropped to that size, as torchvision's ``Resize`` + ``CenterCrop`` do.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ember.shards import (
    DecodeError,
    RayShardLoader,
    ShardDataset,
    ShardError,
    ShardLoader,
    expand_urls,
    ignore_and_continue,
)
from ember.shards.decode import IMAGE_EXTENSIONS
from ember.shards.urls import file_beside, local_path
from ember.train.errors import ConfigError

__all__ = ["IMAGE_KEYS", "ImageExample", "check_shards", "image_class_loader", "image_size_arg",
           "peek_image_shape", "read_class_names", "resize_center_crop"]

IMAGE_KEYS = "png;jpg;jpeg;ppm;pgm;pnm;webp;bmp;tif;tiff"


def image_size_arg(size: int | Sequence[int] | None, name: str = "image_size"
                   ) -> tuple[int, int] | None:
    """``size`` as ``(height, width)``: an int is a square; None stays None."""
    if size is None:
        return None
    sizes = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    try:
        h, w = sizes  # type: ignore[misc]
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an int or a (height, width) pair, got {size!r}") from None
    for v in (h, w):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must hold ints, got {size!r}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {size!r}")
    return h, w


def resize_center_crop(image: Any, size: tuple[int, int]) -> Any:
    """A PIL image scaled (bilinear, aspect kept) until it covers ``size`` = (height, width), then
    center-cropped to it. For a square size this is torchvision's ``Resize(s)`` followed by
    ``CenterCrop(s)`` on PIL images; an image already of ``size`` is returned unchanged."""
    from PIL import Image

    th, tw = size
    w, h = image.size
    if (h, w) == (th, tw):
        return image
    if th * w >= tw * h:  # the height is the binding side: it becomes th
        nh, nw = th, max(tw, int(th * w / h))
    else:
        nh, nw = max(th, int(tw * h / w)), tw
    if (nh, nw) != (h, w):
        image = image.resize((nw, nh), Image.Resampling.BILINEAR)
    top = int(round((nh - th) / 2.0))
    left = int(round((nw - tw) / 2.0))
    return image.crop((left, top, left + tw, top + th))


@functools.lru_cache(maxsize=8)
def _repeated_keys(url: str) -> frozenset[str]:
    """The keys that stand more than once in a local shard (one header scan per shard, so that
    --skip-bad over many such samples scans each shard once)."""
    from collections import Counter

    from ember.shards.errors import ShardError
    from ember.shards.index import build_index

    try:
        counts = Counter(k for k, _, _ in build_index(url)["samples"])
    except (ShardError, OSError):
        return frozenset()
    return frozenset(k for k, n in counts.items() if n > 1)


def _apart_hint(key: str | None, url: str | None) -> str:
    """Why a sample lacks a field when the cause is a tar whose members are not grouped by
    sample (`tar cf` of a folder in directory order): the key comes back later in the shard."""
    if key is None or url is None or local_path(url) is None or key not in _repeated_keys(url):
        return ""
    return ("; its files are not adjacent in the tar, so it reads as several samples: write "
            "the shard with `tar --sort=name` (or `ember shards create`); `ember shards verify` "
            "lists such samples")


class ImageExample:
    """A decoded sample (PIL image and int class) -> ``(image tensor, label)``; errors name the
    shard, the sample key and the cause."""

    def __init__(self, image_size: tuple[int, int] | None, grayscale: bool,
                 num_classes: int | None = None):
        self.image_size = image_size
        self.grayscale = grayscale
        self.num_classes = num_classes

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        import numpy as np

        key, url = sample.get("__key__"), sample.get("__url__")
        images = [k for k in sample if k[:2] != "__" and k.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS]
        if not images:
            raise DecodeError(f"sample {key!r} has no image field (fields: "
                              f"{sorted(k for k in sample if k[:2] != '__')})"
                              f"{_apart_hint(key, url)}", url)
        if "cls" not in sample:
            raise DecodeError(f"sample {key!r} has no .cls label (fields: "
                              f"{sorted(k for k in sample if k[:2] != '__')})"
                              f"{_apart_hint(key, url)}", url)
        label = sample["cls"]
        if isinstance(label, bool) or not isinstance(label, int):
            raise DecodeError(f"sample {key!r}: .cls is not an integer: {label!r}", url)
        if self.num_classes is not None and not 0 <= label < self.num_classes:
            shown = label if abs(label) < 10**30 else f"{str(label)[:12]}... ({len(str(label))} digits)"
            raise DecodeError(f"sample {key!r}: .cls label {shown} is outside [0, "
                              f"{self.num_classes}), the classes of this run (--num-classes)", url)
        if not -(2**63) <= label < 2**63:
            raise DecodeError(f"sample {key!r}: .cls label {str(label)[:12]}... does not fit a "
                              "64-bit integer", url)
        image = sample[images[0]]
        if self.image_size is not None:
            image = resize_center_crop(image, self.image_size)
        arr = np.array(image)  # a writable copy: torch.from_numpy warns on read-only arrays
        t = torch.from_numpy(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1).copy())
        return t.float().div_(255.0), label


def read_class_names(urls: str | Sequence[str]) -> list[str] | None:
    """The class names of the ``classes.json`` files (``{"classes": [...]}``, as ``ember shards
    create`` writes them) next to the shards (local, or remote where files lie beside them:
    http(s), s3), or None when there is none. Folders whose files name other classes are a
    ConfigError: a label would mean one class in one folder and another in the next."""
    folders: dict[str, str] = {}  # folder -> a shard in it
    for url in expand_urls(urls):
        path = local_path(url)
        folder = os.path.dirname(os.path.abspath(path)) if path is not None else url.rsplit("/", 1)[0]
        folders.setdefault(folder, url)
    names, where = None, None
    for folder, url in folders.items():
        if local_path(url) is not None:
            mine = _class_file(os.path.join(folder, "classes.json"))
        else:
            mine = _remote_class_file(url, f"{folder}/classes.json")
        if mine is None:
            continue
        if names is not None and mine != names:
            raise ConfigError(f"the classes.json files in {where} and {folder} name other "
                              f"classes ({_some(names)} against {_some(mine)}): a label would "
                              "not mean one class; write all shards with one class list")
        names, where = mine, folder
    return names


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _class_file(file: str) -> list[str] | None:
    if not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return _class_list(f.read(), file)
    except OSError as exc:
        raise ConfigError(f"{file} is not a classes.json of `ember shards create`: {exc}") from None


def _remote_class_file(shard: str, file: str) -> list[str] | None:
    try:
        data = file_beside(shard, "classes.json")
    except ShardError as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from None
    return None if data is None else _class_list(data, file)


def _class_list(text: str | bytes, file: str) -> list[str]:
    try:
        names = json.loads(text)["classes"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{file} is not a classes.json of `ember shards create`: {exc}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{file}: 'classes' must be a list of names")
    return names


def check_shards(urls: str | Sequence[str], what: str = "--data") -> list[str]:
    """Expand ``urls`` and check that every local shard exists; returns the list of URLs."""
    try:
        expanded = expand_urls(urls)
    except ValueError as exc:
        raise ConfigError(f"{what}: cannot expand {urls!r}: {exc}") from None
    if not expanded:
        raise ConfigError(f"{what}: {urls!r} names no shards")
    missing = []
    for url in expanded:
        path = local_path(url)
        if path is not None and path.is_dir():
            raise ConfigError(f"{what}: {path} is a folder, not tar shards; to train on a folder "
                              "of images (one subfolder per class), first write shards with "
                              f"`ember shards create {path} -o shards/train-%06d.tar`, then pass "
                              "--data 'shards/train-{000000..NNNNNN}.tar'")
        if path is not None and not path.is_file():
            missing.append(str(path))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"{what}: {len(missing)} of {len(expanded)} shards not found: "
                          f"{', '.join(missing[:3])}{more}")
    return expanded


class SkipLog:
    """A ``skip_bad`` that also names what it skips: each skipped shard rest or sample becomes
    one JSON line ``{"shard", "key", "offset", "cause"}`` appended to ``path`` (whole lines, so
    DataLoader worker processes can share the file)."""

    def __init__(self, path: str | os.PathLike, during: str = "training") -> None:
        self.path, self.during = os.fspath(path), during

    def __call__(self, exc: Exception) -> bool:
        cause = " ".join(str(exc).split())
        key = getattr(exc, "key", None)
        if key is None:  # the stages name the sample in their message
            named = re.search(r"sample '([^']*)'", cause)
            key = named.group(1) if named else None
        record = {"shard": getattr(exc, "url", None), "key": key,
                  "offset": getattr(exc, "offset", None), "during": self.during,
                  "cause": cause[:500]}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        return True  # skip it

    def read(self) -> list[dict[str, Any]]:
        """What was skipped so far, in the order it was noted."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def _dataset(urls: Sequence[str], *, seed: int, shuffle: int, grayscale: bool,
             rank: int | None, world_size: int | None, equalize: str | None,
             generator: torch.Generator | None, image_size: tuple[int, int] | None = None,
             skip_bad: bool | SkipLog = False, num_classes: int | None = None) -> ShardDataset:
    # skip_bad: a bad shard's rest (on_error) and a bad sample (the stages' handler) are skipped
    # and counted in error_count (and noted by a SkipLog)
    handler: Any = (skip_bad if isinstance(skip_bad, SkipLog) else ignore_and_continue) \
        if skip_bad else None
    on_error: Any = skip_bad if isinstance(skip_bad, SkipLog) else ("skip" if skip_bad
                                                                    else "raise")
    ds = ShardDataset(list(urls), seed=seed, shuffle_shards=shuffle > 0, rank=rank,
                      world_size=world_size, equalize=equalize, generator=generator,
                      on_error=on_error)
    if shuffle > 0:
        ds = ds.shuffle(shuffle)
    return (ds.decode("pill" if grayscale else "pil", handler=handler)
            .map(ImageExample(image_size, grayscale, num_classes), handler=handler))


def image_class_loader(urls: str | Sequence[str], batch_size: int, *, seed: int = 0,
                       shuffle: int = 1000, grayscale: bool = False, num_workers: int = 0,
                       split_ranks: bool = True, generator: torch.Generator | None = None,
                       ray_address: str | None = None,
                       image_size: int | tuple[int, int] | None = None,
                       skip_bad: bool | SkipLog = False, num_classes: int | None = None
                       ) -> ShardLoader | RayShardLoader:
    """A resumable loader of ``(images, labels)`` batches from image + cls shards.

    ``image_size`` (an int or ``(height, width)``) resizes every image, aspect kept, until it
    covers that size and center-crops it (:func:`resize_center_crop`); without it the images
    must all have one size. A bad shard or sample raises a :class:`~ember.shards.ShardError`
    naming the shard and the sample key; with ``skip_bad`` it is skipped instead and counted in
    the loader's ``error_count``. With ``num_classes`` a label outside ``[0, num_classes)`` is
    such a bad sample.

    ``shuffle`` is the sample shuffle buffer (0: read in order, shard order unshuffled too);
    shuffling is reproducible from ``seed`` and changes every epoch; ``generator`` (e.g. an
    ember.csprng generator) draws the shuffles. With ``split_ranks`` (training data) each
    torch.distributed rank reads its own share, equalised so every rank gets the same number of
    batches; without it (evaluation data) every process reads everything. With
    ``ray_address``, Ray tasks on that cluster read and decode the shards (a RayShardLoader;
    ``num_workers`` does not apply).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    size = image_size_arg(image_size)
    expanded = check_shards(urls)
    rank, world = (None, None) if split_ranks else (0, 1)
    equalize = "drop" if split_ranks and _world_size() > 1 else None
    ds = _dataset(expanded, seed=seed, shuffle=shuffle, grayscale=grayscale, rank=rank,
                  world_size=world, equalize=equalize, generator=generator, image_size=size,
                  skip_bad=skip_bad, num_classes=num_classes)
    if ray_address is not None:
        return RayShardLoader(ds.batched(batch_size), address=ray_address)
    return ShardLoader(ds.batched(batch_size), num_workers=num_workers)


def _world_size() -> int:
    import os

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def peek_image_shape(urls: str | Sequence[str], grayscale: bool = False, *,
                     image_size: int | tuple[int, int] | None = None,
                     skip_bad: bool | SkipLog = False) -> tuple[int, ...]:
    """The ``(channels, height, width)`` of the first image (after ``image_size``'s resize)."""
    size = image_size_arg(image_size)
    expanded = check_shards(urls)
    ds = _dataset(expanded, seed=0, shuffle=0, grayscale=grayscale, rank=0, world_size=1,
                  equalize=None, generator=None, image_size=size, skip_bad=skip_bad)
    for image, _ in ds:
        return tuple(image.shape)
    raise ConfigError(f"{expanded[0]}{' ...' if len(expanded) > 1 else ''} holds no "
                      "image + cls samples")
