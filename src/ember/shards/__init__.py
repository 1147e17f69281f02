"""ember.shards: read and write WebDataset-format tar shards from disk, HTTP, S3 and pipes.

Reading: :class:`ShardDataset` (an IterableDataset with a webdataset-like fluent pipeline) and
:class:`ShardLoader` (a DataLoader wrapper with exact ``state_dict()``), or
:class:`RayShardLoader` (the same pipeline run as Ray tasks on a cluster). Writing:
:class:`TarWriter`, :class:`ShardWriter`. Tools: ``ember shards ...``.
"""

from ember.shards.dataset import ShardDataset, ShardLoader, iter_shard, rank_and_world
from ember.shards.decode import Decoder, handle_extension, imagehandler
from ember.shards.errors import (
    DecodeError,
    FormatError,
    NotFoundError,
    ShardError,
    TruncatedShardError,
)
from ember.shards.format import group_samples, split_name
from ember.shards.ray_loader import RayShardLoader
from ember.shards.stages import (
    default_collate,
    ignore_and_continue,
    reraise_exception,
    warn_and_continue,
    warn_and_stop,
)
from ember.shards.urls import UrlOptions, expand_urls, local_path, open_url, register_opener
from ember.shards.writer import ShardWriter, TarWriter, encode_field

__all__ = [
    "ShardDataset", "ShardLoader", "iter_shard", "rank_and_world", "RayShardLoader",
    "Decoder", "handle_extension", "imagehandler",
    "ShardError", "NotFoundError", "FormatError", "TruncatedShardError", "DecodeError",
    "split_name", "group_samples", "default_collate",
    "reraise_exception", "warn_and_continue", "ignore_and_continue", "warn_and_stop",
    "expand_urls", "open_url", "local_path", "UrlOptions", "register_opener",
    "TarWriter", "ShardWriter", "encode_field",
]
