"""The WebDataset naming rules: member name <-> (key, extension), and members -> samples.

Both the reader and the writer import this module, so the two can never disagree about what a
sample is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ember.shards.errors import FormatError

try:  # group_samples compiled (setup.py); None where it was not built
    from ember.shards._speedups import group_samples as _compiled_group_samples
except ImportError:  # pragma: no cover - depends on the build
    _compiled_group_samples = None

__all__ = ["split_name", "member_name", "group_samples", "is_metadata", "is_hidden", "unsafe_name",
           "check_sample_names"]

META_KEYS = ("__key__", "__url__")


def is_metadata(name: str) -> bool:
    """Whether webdataset skips a member name as metadata: a name without ``/`` that starts and
    ends with ``__``, or one whose first path part is ``__something__`` (``__meta__/x.json``)."""
    if name[:2] != "__":
        return False
    slash = name.find("/")
    if slash < 0:
        return name.endswith("__")
    return slash >= 4 and name[slash - 2 : slash] == "__"


def is_hidden(name: str) -> bool:
    """Whether a member's basename starts with a dot (``./.DS_Store``, macOS's ``._a.jpg``):
    webdataset skips such members."""
    return name[name.rfind("/") + 1 : name.rfind("/") + 2] == "."


def unsafe_name(name: str) -> str | None:
    """Why a member name is unsafe to yield (absolute, or a ``..`` part that climbs out of the
    folder it would be extracted to), or None."""
    if name.startswith("/"):
        return "an absolute path"
    if ".." in name and ".." in name.split("/"):
        return "a '..' part"
    return None


def split_name(name: str) -> tuple[str, str] | None:
    """Return ``(key, extension)`` for a member name, or None if it belongs to no sample (no dot
    in its basename, a hidden basename, or webdataset's metadata pattern).

    The split is at the first dot of the last path component; the extension is lower-cased.
    """
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash or is_metadata(name):
        return None
    return name[:dot], name[dot + 1 :].lower()


def member_name(key: str, ext: str) -> str:
    """The member name under which ``ext`` of the sample ``key`` is stored (inverse of split_name)."""
    return f"{key}.{ext}"


def check_sample_names(key: Any, exts: Iterable[str]) -> None:
    """Raise FormatError unless ``key`` and ``exts`` survive a write/read round trip unchanged,
    in ember and in webdataset, naming the rule broken."""
    if not isinstance(key, str) or not key:
        raise FormatError(f"sample key must be a non-empty string, got {key!r}")
    if "\0" in key:
        raise FormatError(f"sample key {key!r} holds a NUL character: a tar header ends the "
                          "member name there, so no reader would give the sample back")
    last = key[key.rfind("/") + 1 :]
    if "." in last:
        raise FormatError(
            f"sample key {key!r} has a dot in its last path component; the reader would split it"
        )
    if not last:
        raise FormatError(f"sample key {key!r} ends with '/'")
    why = unsafe_name(key)
    if why is not None:
        raise FormatError(f"sample key {key!r} is unsafe ({why}): readers refuse such names, "
                          "and extracting them writes outside the target folder")
    for ext in exts:
        if not ext or ext != ext.lower() or ext.startswith("__") or "/" in ext or "\0" in ext:
            raise FormatError(
                f"extension {ext!r} of sample {key!r} must be non-empty, lower-case, without '/' "
                "or a NUL character, and not start with '__'"
            )
        if is_metadata(member_name(key, ext)):
            raise FormatError(
                f"member {member_name(key, ext)!r} of sample {key!r} matches webdataset's metadata "
                "pattern (a first path part '__name__', or a whole name '__...__'): webdataset "
                "skips it; use another key"
            )


def group_samples(
    members: Iterable[tuple[str, bytes, int]], url: str
) -> Iterator[dict[str, object]]:
    """Group consecutive members ``(name, data, offset)`` with the same key into sample dicts.

    A sample is yielded only once the next key starts or the member stream ends normally, so an
    exception from ``members`` (a truncated shard) never lets an incomplete sample through.
    """
    if _compiled_group_samples is not None:
        return _compiled_group_samples(members, url, FormatError)
    return _group_samples(members, url)


def _group_samples(members: Iterable[tuple[str, bytes, int]], url: str) -> Iterator[dict[str, object]]:
    """group_samples in Python: the reference for the compiled one in _speedups.c."""
    current: dict[str, object] | None = None
    key = None
    lowered: dict[str, str] = {}  # extension -> lower case: the same few repeat in every sample
    for name, data, offset in members:
        slash = name.rfind("/") + 1
        dot = name.find(".", slash)
        if dot <= slash:
            continue  # no extension, or a hidden basename: not a sample member
        if name[0] == "_" and is_metadata(name):
            continue
        k = name[:dot]
        if k != key:  # (key starts as None, so the first member starts a sample)
            if current is not None:
                yield current
            # a key holds its unsafe part: only the first member of a sample needs the check
            if (name[0] == "/" or ".." in k) and unsafe_name(k):
                current = None
                raise FormatError(f"member name {name!r} is unsafe ({unsafe_name(k)})", url,
                                  offset)
            current = {"__key__": k, "__url__": url}
            key = k
        assert current is not None  # (the first member of a sample made it)
        ext = name[dot + 1 :]
        low = lowered.get(ext)
        if low is None:
            if len(lowered) >= 256:
                lowered.clear()
            low = lowered[ext] = ext.lower()
        ext = low
        if ext in current:
            if ext in META_KEYS:
                raise FormatError(f"member {name!r} uses the reserved extension {ext!r}", url, offset)
            raise FormatError(f"duplicate file name {name!r} in sample {k!r}", url, offset)
        current[ext] = data
    if current is not None:
        yield current
