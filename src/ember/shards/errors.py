"""Exceptions raised by ember.shards; every one names the shard and, where known, the byte offset."""

from __future__ import annotations

__all__ = ["ShardError", "NotFoundError", "FormatError", "TruncatedShardError", "DecodeError"]


class ShardError(Exception):
    """A shard could not be opened or parsed.

    ``url`` is the shard, ``offset`` the byte offset (in the uncompressed tar stream) where the
    problem was found, or None when it is not about a position.
    """

    def __init__(self, message: str, url: str | None = None, offset: int | None = None):
        self.message = message
        self.url = url
        self.offset = offset
        super().__init__(self._text())

    def _text(self) -> str:
        where = ""
        if self.url is not None:
            where = f"shard {self.url}"
            if self.offset is not None:
                where += f" at byte {self.offset}"
            where += ": "
        return where + self.message

    def __reduce__(self):
        return (type(self), (self.message, self.url, self.offset))


class NotFoundError(ShardError):
    """There is no shard (or file) at that URL: no such file, HTTP 404 or 410, S3 NoSuchKey."""


class FormatError(ShardError):
    """A shard is a valid tar but breaks the WebDataset rules (duplicate names, bad keys)."""


class TruncatedShardError(ShardError):
    """A shard ended before its end-of-archive marker or in the middle of a member."""


class DecodeError(ShardError):
    """A sample field could not be decoded; names the sample key and extension."""
