"""Image-classification data from WebDataset shards: an image member plus a ``.cls`` label.

The convention is webdataset's: each sample has one image (``png``, ``jpg``, ``jpeg``, ``ppm``,
``pgm``, ``webp`` ...) and an integer class in ``cls``. Images are decoded to float tensors in
[0, 1] of shape ``(channels, height, width)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember.shards import RayShardLoader, ShardDataset, ShardLoader, expand_urls
from ember.shards.urls import local_path
from ember.train.errors import ConfigError

__all__ = ["IMAGE_KEYS", "check_shards", "image_class_loader", "peek_image_shape"]

IMAGE_KEYS = "png;jpg;jpeg;ppm;pgm;pnm;webp;bmp;tif;tiff"


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
        if path is not None and not path.is_file():
            missing.append(str(path))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"{what}: {len(missing)} of {len(expanded)} shards not found: "
                          f"{', '.join(missing[:3])}{more}")
    return expanded


def _dataset(urls: Sequence[str], *, seed: int, shuffle: int, grayscale: bool,
             rank: int | None, world_size: int | None, equalize: str | None,
             generator: torch.Generator | None) -> ShardDataset:
    ds = ShardDataset(list(urls), seed=seed, shuffle_shards=shuffle > 0, rank=rank,
                      world_size=world_size, equalize=equalize, generator=generator)
    if shuffle > 0:
        ds = ds.shuffle(shuffle)
    ds = ds.decode("torchl" if grayscale else "torchrgb").to_tuple(IMAGE_KEYS + " cls")
    # "torchl" gives (H, W) images, as in webdataset: add the channel axis models expect
    return ds.map(_channel_axis) if grayscale else ds


def _channel_axis(item: tuple) -> tuple:
    image, label = item
    return image.unsqueeze(0), label


def image_class_loader(urls: str | Sequence[str], batch_size: int, *, seed: int = 0,
                       shuffle: int = 1000, grayscale: bool = False, num_workers: int = 0,
                       split_ranks: bool = True, generator: torch.Generator | None = None,
                       ray_address: str | None = None) -> ShardLoader | RayShardLoader:
    """A resumable loader of ``(images, labels)`` batches from image + cls shards.

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
    expanded = check_shards(urls)
    rank, world = (None, None) if split_ranks else (0, 1)
    equalize = "drop" if split_ranks and _world_size() > 1 else None
    ds = _dataset(expanded, seed=seed, shuffle=shuffle, grayscale=grayscale, rank=rank,
                  world_size=world, equalize=equalize, generator=generator)
    if ray_address is not None:
        return RayShardLoader(ds.batched(batch_size), address=ray_address)
    return ShardLoader(ds.batched(batch_size), num_workers=num_workers)


def _world_size() -> int:
    import os

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def peek_image_shape(urls: str | Sequence[str], grayscale: bool = False) -> tuple[int, ...]:
    """The ``(channels, height, width)`` of the first image in the first shard."""
    expanded = check_shards(urls)
    ds = _dataset(expanded[:1], seed=0, shuffle=0, grayscale=grayscale, rank=0, world_size=1,
                  equalize=None, generator=None)
    for image, _ in ds:
        return tuple(image.shape)
    raise ConfigError(f"first shard {expanded[0]} holds no image + cls samples")
