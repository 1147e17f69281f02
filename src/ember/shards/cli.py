"""The ``ember shards`` command: ls, cat, stats, verify, split, merge, shuffle, index, create."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from ember.shards.dataset import ShardDataset
from ember.shards.decode import IMAGE_EXTENSIONS, MAX_PIXELS
from ember.shards.errors import ShardError
from ember.shards.format import group_samples, is_metadata, split_name, unsafe_name
from ember.shards.index import (
    INDEX_SUFFIX,
    build_index,
    index_path,
    read_index,
    read_sample,
    sample_count,
    write_index,
)
from ember.shards.reading import _samples, iter_shard
from ember.shards.tar import Link, iter_members, open_tar_source
from ember.shards.urls import UrlOptions, expand_urls, file_beside, local_path
from ember.shards.writer import ShardWriter, TarWriter, shard_path

__all__ = ["register"]


def _urls(args) -> list[str]:
    """The input URLs; ``-`` (standard input, a tar stream) is kept as it is."""
    out: list[str] = []
    for u in args.urls:
        out += ["-"] if u == "-" else expand_urls(u)
    if out.count("-") > 1:
        raise ValueError("standard input ('-') can be read once only")
    return out


def _read(url: str, options: UrlOptions | None = None):
    """The raw samples of one input shard (``-``: a tar stream on standard input)."""
    if url == "-":
        return _samples(sys.stdin.buffer, "-")
    return iter_shard(url, options)


def _options(args) -> UrlOptions:
    return UrlOptions(allow_pipe=args.allow_pipe)


@contextlib.contextmanager
def _progress(items, args, unit: str = "shard", total: int | None = None):
    """The items, counted by a tqdm progress bar on stderr (off with -q), used with ``with``.
    The bar is first drawn once an item is done (so an input refused at once gives the error
    line alone), drawn in full at a normal end, and wiped on an error so that the error message
    is the line that remains."""
    if total is None:
        try:
            total = len(items)
        except (TypeError, AttributeError):
            total = None
    bar = tqdm(total=total, disable=args.quiet, unit=unit, file=sys.stderr, delay=0.05)

    def counted():
        for item in items:
            yield item
            bar.update(1)

    try:
        yield counted()
    except BaseException:
        bar.leave = False
        raise
    else:
        bar.delay = 0  # a short run never drew the bar: draw its end
    finally:
        bar.close()


def _ls(args) -> int:
    total = 0
    with _progress(_urls(args), args) as bar:
        for url in bar:
            n = sum(1 for _ in _read(url)) if url == "-" else sample_count(url, _options(args))
            total += n
            print(f"{n}\t{url}")
    print(f"{total}\ttotal")
    return 0


def _text(v: bytes) -> str:
    return bytes(v).decode("utf-8", "replace")


def _cat_tar(args) -> int:
    """``cat --tar``: the samples of every input as one tar stream on standard output."""
    if sys.stdout.isatty():
        raise ValueError("--tar writes a tar stream; redirect standard output to a file or pipe")
    urls, options = _urls(args), _options(args)
    left = args.n
    with TarWriter(sys.stdout.buffer) as w:
        samples = _unique_samples((s for url in urls for s in _read(url, options)), join=True)
        for s in samples:
            if left == 0:
                break
            w.write({k: v for k, v in s.items() if k != "__url__"})
            if left is not None:
                left -= 1
    sys.stdout.buffer.flush()
    return 0


def _cat(args) -> int:
    if args.n is not None and args.n < 0:
        raise ValueError(f"-n must be >= 0, got {args.n}")
    if args.tar:
        listing = [f for f, on in (("--json", args.json), ("--values", args.values)) if on]
        if listing:
            raise ValueError(f"--tar writes the samples as a tar stream, {listing[0]} formats "
                             "the listing: pass one of them")
        return _cat_tar(args)
    left = args.n
    for url in _urls(args):
        if left == 0:
            break
        samples = _read(url, _options(args))
        try:
            for s in samples:
                fields = {k: (json.dumps(_text(v)) if args.values else len(v))
                          for k, v in s.items() if k[:2] != "__"}
                if args.json:
                    print(json.dumps({"__key__": s["__key__"], **fields}))
                elif args.values:
                    print(s["__key__"], " ".join(f"{k}={v}" for k, v in fields.items()))
                else:  # sizes, labelled so that `cls: 1 bytes` does not read as class 1
                    print(f"{s['__key__']}  "
                          + ", ".join(f"{k}: {v} bytes" for k, v in fields.items()))
                if left is not None:
                    left -= 1
                    if left == 0:
                        break
        finally:
            samples.close()
    return 0


def _stats(args) -> int:
    rows: list[dict] = []
    total: dict[str, Any] = {"samples": 0, "bytes": 0, "extensions": {}}
    with _progress(_urls(args), args) as bar:
        for url in bar:
            n, size = 0, 0
            exts: dict[str, int] = {}
            for s in _read(url, _options(args)):
                n += 1
                for k, v in s.items():
                    if k[:2] != "__":
                        size += len(v)
                        exts[k] = exts.get(k, 0) + 1
            rows.append({"shard": url, "samples": n, "bytes": size, "extensions": exts})
            total["samples"] += n
            total["bytes"] += size
            for k, c in exts.items():
                total["extensions"][k] = total["extensions"].get(k, 0) + c
    if args.json:
        print(json.dumps({"total": total, "shards": rows}))
    else:
        for r in rows + [{"shard": "total", **total}]:
            print(f"{r['samples']}\t{r['bytes']}\t{json.dumps(r['extensions'])}\t{r['shard']}")
    return 0


def _index_problem(url: str, keys: list[str]) -> str | None:
    """What is wrong with the index of a local shard whose samples have ``keys``, if anything."""
    if local_path(url) is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a stale index is reported here instead
            index = read_index(url)
    except (ShardError, ValueError) as exc:
        return f"unreadable index {index_path(url)}: {exc}"
    if index is None:
        return f"stale index {index_path(url)}" if index_path(url).exists() else None
    indexed = [k for k, _, _ in index["samples"]]
    if indexed != keys:
        return (f"index {index_path(url)} lists {len(indexed)} samples that do not match the "
                f"shard's {len(keys)}; rebuild it with `ember shards index`")
    return None


def _apart(key: str, where: str) -> str:
    """The problem of a key that comes back after other samples within one tar."""
    return (f"the files of sample {key!r} are not adjacent in {where} (or two samples share the "
            "key), so it reads as several samples; write the tar with its files sorted "
            "(`tar --sort=name`, or `ember shards create` from the folder)")


def _split_sample(keys: list[str]) -> str | None:
    """What is wrong where a key comes back after other samples in one shard; None where every
    key is one sample."""
    seen: set[str] = set()
    for k in keys:
        if k in seen:
            return _apart(k, "the tar")
        seen.add(k)
    return None


def _verify(args) -> int:
    urls = _urls(args)
    bad = samples = bad_indexes = 0
    with _progress(urls, args) as bar:
        for url in bar:
            keys: list[str] = []
            try:
                for s in _read(url, _options(args)):
                    keys.append(s["__key__"])
            except ShardError as exc:
                bad += 1
                samples += len(keys)  # those read before the error
                print(f"CORRUPT {exc}")
                continue
            samples += len(keys)
            split = _split_sample(keys)
            if split is not None:
                bad += 1
                print(f"SPLIT SAMPLE shard {url}: {split}")
                continue
            problem = _index_problem(url, keys)
            if problem is not None:
                bad_indexes += 1
                print(f"BAD INDEX shard {url}: {problem}")
    print(f"{len(urls) - bad} of {len(urls)} shards ok, {samples} samples read, {bad} corrupt"
          + (f", {bad_indexes} with a bad index" if bad_indexes else ""))
    return 1 if bad or bad_indexes else 0


def _check_output(pattern: str, urls: list[str]) -> None:
    """Refuse an output pattern without a shard number, or one that names one of the input
    shards (it would be overwritten while it may still have to be read)."""
    if shard_path(pattern, 0) == shard_path(pattern, 1):
        raise ValueError(f"-o {pattern} has no shard number, so every shard would get the same "
                         "name; use e.g. -o out-%06d.tar or -o 'out-{:06d}.tar'")
    probe = os.path.abspath(shard_path(pattern, 123456789))
    prefix, sep, suffix = probe.partition("123456789")
    if not sep:
        return
    for url in urls:
        path = local_path(url)
        if path is None:
            continue
        p = os.path.abspath(path)
        if not (p.startswith(prefix) and p.endswith(suffix)
                and len(p) > len(prefix) + len(suffix)):
            continue
        number = p[len(prefix) : len(p) - len(suffix)]
        if number.isdigit() and os.path.abspath(shard_path(pattern, int(number))) == p:
            raise ValueError(f"output pattern {pattern!r} names the input shard {url}; write "
                             "the output somewhere else")


def _post(command: str | None) -> Callable[[str], None] | None:
    """``--post CMD``: run CMD (no shell; ``{}`` replaced by the shard's path, else the path is
    appended) on each finished shard; a failure stops the command."""
    if command is None:
        return None
    try:
        argv = shlex.split(command)
    except ValueError as exc:  # an open quote
        raise ValueError(f"--post {command!r}: {str(exc).lower()}") from exc
    if not argv:
        raise ValueError("--post needs a command")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"--post: no program {argv[0]!r} found (on PATH, or as an executable "
                         "file)")

    def run(path: str) -> None:
        args = [a.replace("{}", path) for a in argv] if any("{}" in a for a in argv) \
            else [*argv, path]
        try:
            done = subprocess.run(args, check=False)
        except OSError as exc:
            raise ValueError(f"--post command {argv[0]!r} could not run on {path}: {exc}") from None
        if done.returncode != 0:
            raise ValueError(f"--post command failed (exit status {done.returncode}) on {path}")

    return run


def _existing_outputs(pattern: str) -> list[str]:
    """Files already present that a run of ``pattern`` could leave beside its new shards: shards
    of that pattern (any number) and their ``.idx`` files."""
    probe = shard_path(pattern, 123456789)
    prefix, sep, suffix = probe.partition("123456789")
    if not sep:
        return []
    folder, start = os.path.split(prefix)
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return []
    found = []
    for name in sorted(names):
        shard = name[: -len(INDEX_SUFFIX)] if name.endswith(INDEX_SUFFIX) else name
        if not (shard.startswith(start) and shard.endswith(suffix)):
            continue
        number = shard[len(start) : len(shard) - len(suffix)]
        if number.isdigit() and os.path.basename(shard_path(pattern, int(number))) == shard:
            found.append(os.path.join(folder, name))
    return found


def _check_overwrite(args) -> list[str]:
    """Refuse to write over existing shards (or their stale ``.idx`` files) unless ``--force``;
    returns the files that the finished run must remove (the old ones it did not replace)."""
    existing = _existing_outputs(args.output)
    if existing and not args.force:
        more = f" and {len(existing) - 2} more" if len(existing) > 2 else ""
        raise ValueError(f"{', '.join(existing[:2])}{more} already exist for -o {args.output}; "
                         "pass --force to replace them (all shards and .idx files of that "
                         "pattern), or choose another -o")
    return existing


def _writer(args, pattern: str) -> ShardWriter:
    """The writer of ``-o``'s shards under ``pattern`` (a temporary folder); ``--post`` runs on
    the shards once they are in place."""
    _post(getattr(args, "post", None))  # a bad --post is refused before anything is written
    return ShardWriter(pattern, maxcount=_count(args.maxcount),
                       maxsize=_byte_size(args.maxsize), encode=False)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def _byte_size(text: str) -> int:
    """``--maxsize``: a number of bytes with an optional unit (``3e9``, ``500MB``, ``1GiB``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"--maxsize expects a size such as 3e9, 500MB or 1GiB, got {text!r}")
    number = m.group(1)  # a whole number exactly (2**63 - 1 is no float)
    value = int(number) * _UNITS[unit] if number.isdigit() else float(number) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"--maxsize must be at least 1 byte, got {text!r}")
    if not value < 2**63:  # infinity too (1e400)
        raise ValueError(f"--maxsize must be below 2**63 bytes (8 EiB), got {text!r}")
    return int(value)


def _count(text: str) -> int:
    """``--maxcount``: a positive whole number (``100000`` or ``1e5``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (1 <= value < 2**63 and value == int(value)):
        raise ValueError(f"--maxcount must be a whole number >= 1, got {text!r}")
    return int(value)


def _stem(url: str | None) -> str:
    name = os.path.basename(str(url or "input").rstrip("/"))
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if name.endswith(suffix):
            return name[: -len(suffix)] or "input"
    return name or "input"


def _unique_samples(samples, join: bool):
    """The samples with keys made unique: a sample split across the end of one input shard and
    the start of the next (same key, no common field) is joined back into one; any other sample
    whose key was already written is renamed ``<source shard stem>/<key>`` (keys that restart at
    0 in every shard are common), so the output never holds two samples with one key. A key
    that comes back within one input shard (its files are not adjacent there) is refused."""
    seen: dict[str, object] = {}  # key written -> the input shard it came from
    held = None
    for s in samples:
        if held is not None:
            if (join and s["__key__"] == held["__key__"] and s.get("__url__") != held.get("__url__")
                    and not (set(s) & set(held)) - {"__key__", "__url__"}):
                held = {**held, **{k: v for k, v in s.items() if k != "__url__"}}
                continue
            yield held
        key, url = s["__key__"], s.get("__url__")
        if key in seen:
            if seen[key] == url:
                raise ValueError(_apart(key, "the tar stream on standard input" if url == "-"
                                        else str(url)))
            new = f"{_stem(url)}/{key}"
            if new in seen:
                raise ValueError(f"sample key {key!r} of {url} occurs twice and "
                                 f"{new!r} too; give the input samples unique keys")
            s = {**s, "__key__": new}
            key = new
        seen[key] = url
        held = s
    if held is not None:
        yield held


def _check_written(shards: list[str], keys: list[str]) -> None:
    """Read back every shard written and compare with what was written."""
    got = [s["__key__"] for path in shards for s in iter_shard(path)]
    if got != keys:
        what = "different keys" if len(got) == len(keys) else "count differs"
        raise ShardError(f"read back {len(got)} samples from the {len(shards)} shards written, "
                         f"expected {len(keys)} ({what}); the output was removed")


@contextlib.contextmanager
def _signal_handlers(signums: tuple[int, ...], handler):
    """Install ``handler`` for ``signums`` in the main thread and put the old handlers back at
    the end; yields whether it could (not outside the main thread or in an embedded
    interpreter)."""
    before = {}
    if threading.current_thread() is threading.main_thread():
        try:
            for signum in signums:
                before[signum] = signal.signal(signum, handler)
        except (ValueError, OSError):
            for signum, old in before.items():
                signal.signal(signum, old)
            before = {}
    try:
        yield bool(before)
    finally:
        for signum, old in before.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _no_interrupt():
    """Hold Ctrl-C (SIGINT), SIGTERM and SIGHUP back while files are moved into place or put
    back, so that no signal can leave half a swap; the first one held back is raised at the
    end."""
    held: list[int] = []
    with _signal_handlers(_STOP_SIGNALS, lambda n, _frame: held.append(n)):
        yield
    if held:
        raise _Stopped(held[0])


# the signals that end a command the way Ctrl-C does: the terminal's Ctrl-C, `kill` / `timeout` /
# a scheduler's limit, a closed terminal
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP")
                      if hasattr(signal, n))


class _Stopped(KeyboardInterrupt):
    """A stop signal turned into an exception (SIGINT arrives as KeyboardInterrupt itself)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_signals_raise():
    """SIGTERM and SIGHUP raise _Stopped in the main thread while a command runs, so that its
    clean-up runs as for Ctrl-C."""

    def stop(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    return _signal_handlers(tuple(n for n in _STOP_SIGNALS if n != signal.SIGINT), stop)


def _check_out_folder(pattern: str) -> None:
    """Refuse an output pattern whose folder cannot be made because a file stands in its way."""
    path = os.path.dirname(os.path.abspath(shard_path(pattern, 0)))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
    if not os.path.isdir(path):
        raise ValueError(f"-o: {path} is a file, not a folder")


def _missing_folders(folder: str) -> list[str]:
    """The folders of ``folder``'s path that do not exist yet, deepest first."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


def _aside(path: str, tmp: str, sub: str = "") -> str:
    """Where ``path`` waits in the temporary folder ``tmp`` (a name) of its own folder (in its
    subfolder ``sub``, if given)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, tmp, sub, name) if sub else os.path.join(folder, tmp, name)


def _stage_extra(extra: dict[str, bytes], tmp: str) -> list[tuple[str, str]]:
    """Write the ``extra`` files (path -> bytes) into the temporary folder ``tmp``; returns
    ``(staged, final)`` pairs."""
    staged_files = []
    for path, data in extra.items():
        staged = _aside(path, tmp)
        os.makedirs(os.path.dirname(staged), exist_ok=True)
        with open(staged, "wb") as f:
            f.write(data)
        staged_files.append((staged, path))
    return staged_files


def _swap_in(new: list[tuple[str, str]], old: list[str], tmp: str,
             moved: list[tuple[str, str]], placed: list[str]) -> None:
    """Move the files they replace aside (recorded in ``moved``), then the new files into their
    place (recorded in ``placed``), with stop signals held back."""
    with _no_interrupt():
        known = {os.path.abspath(p) for p in old}
        replaced = [*old, *(f for _, f in new
                            if os.path.lexists(f) and os.path.abspath(f) not in known)]
        for path in replaced:
            waiting = _aside(path, tmp, "old")
            os.makedirs(os.path.dirname(waiting), exist_ok=True)
            os.replace(path, waiting)
            moved.append((path, waiting))
        for staged, final in new:
            os.replace(staged, final)
            placed.append(final)


def _undo(placed: list[str], moved: list[tuple[str, str]]) -> None:
    """Remove the new files and put the old ones back."""
    for path in placed:
        with contextlib.suppress(OSError):
            os.remove(path)
    for path, waiting in reversed(moved):
        os.replace(waiting, path)


def _write_all(args, urls: list[str], samples, join: bool = False,
               extra: dict[str, bytes] | None = None) -> int:
    """Write ``samples`` as shards of ``-o`` all or nothing: the shards (and ``extra`` files,
    path -> bytes) are written into a hidden temporary folder next to the output, read back,
    and only then moved into place, the files they replace (``--force``) moved aside first and
    deleted at the very end. Any failure or Ctrl-C puts the old files back, byte for byte, and
    removes the output folders the run made."""
    _check_write_flags(args, urls)
    old = _check_overwrite(args)
    made = _missing_folders(os.path.dirname(os.path.abspath(shard_path(args.output, 0))))
    tmp = f".ember-writing-{uuid.uuid4().hex[:12]}"  # no '%' or braces: a pattern stays one
    head, base = os.path.split(args.output)
    w = _writer(args, os.path.join(head, tmp, base))
    keys: list[str] = []
    moved: list[tuple[str, str]] = []  # (old file, where it waits)
    placed: list[str] = []  # new files in their final place
    done = False
    try:
        with w:
            for s in _unique_samples(samples, join):
                w.write({k: v for k, v in s.items() if k != "__url__"})
                keys.append(s["__key__"])
        _check_written(w.shards, keys)
        new = [(p, os.path.join(os.path.dirname(os.path.dirname(p)), os.path.basename(p)))
               for p in w.shards]
        _swap_in(new + _stage_extra(extra or {}, tmp), old, tmp, moved, placed)
        post = _post(getattr(args, "post", None))
        if post is not None:
            for _, final in new:
                post(final)
        done = True
        args.written = True  # for the message of a Ctrl-C that comes from here on
    finally:
        with _no_interrupt():
            if not done:  # a failed command leaves no new files and every old one as it was
                _undo(placed, moved)
            folders = {os.path.dirname(shard_path(w.pattern, i)) for i in range(w.shard)}
            folders |= {os.path.dirname(_aside(p, tmp)) for p in [*(extra or {}), *old]}
            for folder in folders:  # the temporary folders: partial shards, old files
                shutil.rmtree(folder, ignore_errors=True)
            if not done:  # the folders made for the temporary folder, now empty
                for folder in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
    n = len(w.shards)
    print(f"wrote {w.total} sample{'s' * (w.total != 1)} to {n} shard{'s' * (n != 1)} (read back "
          "and checked)"
          + (f"; replaced {len(old)} files that were there (--force)" if old else ""))
    return 0


def _carried_classes(args, urls: list[str]) -> dict[str, bytes] | None:
    """The ``classes.json`` beside the input shards, to be written beside -o's shards too; None
    where there is none. Inputs whose files name other classes, or of which only some have one,
    are refused."""
    options = _options(args)
    found: dict[str, bytes] = {}  # folder -> classes.json
    without: list[str] = []  # folders without one
    for url in urls:
        if url == "-":
            continue
        folder = url.rsplit("/", 1)[0] if local_path(url) is None else \
            os.path.dirname(os.path.abspath(local_path(url) or ""))
        if folder not in found and folder not in without:
            data = file_beside(url, "classes.json", options, required=True)
            if data is not None:
                found[folder] = data
            else:
                without.append(folder)
    if found and without:
        raise ValueError(f"the input shards in {next(iter(found))} have a classes.json, those in "
                         f"{without[0]} have none: the labels of the output would name classes "
                         "for some samples only; give all the inputs one classes.json, or none")
    kinds = sorted(set(found.values()))
    if len(kinds) > 1:
        where = [f for f, d in found.items() if d != kinds[0]][0]
        raise ValueError(f"the input shards' classes.json files name other classes (in "
                         f"{next(iter(found))} and {where}): a label would not mean one class")
    return _classes_file(args, kinds[0]) if kinds else None


def _reshard(args) -> int:
    urls = _urls(args)
    options = _options(args)
    _check_write_flags(args, urls)
    extra = _carried_classes(args, urls)
    with _progress(urls, args) as bar:
        return _write_all(args, urls, (s for url in bar for s in _read(url, options)),
                          join=True, extra=extra)


def _gzipped(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"\x1f\x8b"
    except OSError:
        return False  # reported when the shard is read


def _no_stdin(urls: list[str], why: str) -> None:
    if "-" in urls:
        raise ValueError(f"'-' (a tar stream on standard input) cannot be read here: {why}; "
                         "write the stream to shards first (`ember shards split - -o "
                         "in-%06d.tar`)")


def _shuffle(args) -> int:
    urls = _urls(args)
    _no_stdin(urls, "shuffle reads its input shards more than once")
    if args.buffer < 0:
        raise ValueError(f"--buffer must be >= 0, got {args.buffer}")
    _check_write_flags(args, urls)
    if args.buffer:
        extra = _carried_classes(args, urls)
        ds = ShardDataset(urls, seed=args.seed, url_options=_options(args)).shuffle(args.buffer)
        with _progress(ds, args, unit="sample") as bar:
            return _write_all(args, urls, bar, extra=extra)
    remote = [u for u in urls if local_path(u) is None]
    if remote:
        raise ValueError(f"a global shuffle reads samples by byte offset, so it needs local "
                         f"shards, not {remote[0]}; use --buffer N to shuffle through a buffer")
    compressed = [u for u in urls if _gzipped(str(local_path(u)))]
    if compressed:
        raise ValueError(f"a global shuffle reads samples by byte offset, so it needs "
                         f"uncompressed shards, not the gzipped {compressed[0]}; use --buffer N "
                         "to shuffle through a buffer")
    extra = _carried_classes(args, urls)
    with _progress(urls, args) as bar:
        spans = [(u, (s, e)) for u in bar for _, s, e in build_index(u)["samples"]]
    g = torch.Generator().manual_seed(args.seed)
    order = [spans[i] for i in torch.randperm(len(spans), generator=g).tolist()]
    with _progress(order, args, unit="sample") as bar:
        return _write_all(args, urls, ({**read_sample(u, span), "__url__": u} for u, span in bar),
                          extra=extra)


def _hidden(name: str) -> bool:
    """A hidden file or folder (``.DS_Store``, macOS's ``._photo.jpg``, ``.git``): left out."""
    return name.startswith(".")


@dataclasses.dataclass
class _Found:
    """What walking an ImageFolder found: the images as ``(class index, class name, sample key,
    path)``, and what was left out or changed."""

    images: list[tuple[int, str, str, str]] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)  # not an image by extension
    hidden: list[str] = dataclasses.field(default_factory=list)  # name starting with '.'
    loops: list[str] = dataclasses.field(default_factory=list)  # symlinked folders walked already
    renamed: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (path, key)
    special: list[str] = dataclasses.field(default_factory=list)  # FIFOs, devices, sockets
    symlinks: list[str] = dataclasses.field(default_factory=list)  # a tar stream's symlinks
    broken: list[str] = dataclasses.field(default_factory=list)  # "path: why it cannot be read"
    empty: list[str] = dataclasses.field(default_factory=list)  # class folders without images


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _walk_class(top: str, found: _Found, seen: set) -> list[tuple[str, str, str]]:
    """``(relative folder, file name, path)`` of every file under ``top``; symlinked folders are
    followed, each folder once (one already walked, a loop or a second link, is left out)."""
    entries = []
    for folder, dirs, files in os.walk(top, followlinks=True):
        keep = []
        for d in sorted(dirs):
            path = os.path.join(folder, d)
            ident = _identity(path)
            if _hidden(d):
                found.hidden.append(path)
            elif ident is not None and ident in seen:
                found.loops.append(path)
            else:
                seen.add(ident)
                keep.append(d)
        dirs[:] = keep
        rel = os.path.relpath(folder, top).replace(os.sep, "/")
        for fname in sorted(files):
            if _hidden(fname):
                found.hidden.append(os.path.join(folder, fname))
            else:
                entries.append(("" if rel == "." else rel, fname, os.path.join(folder, fname)))
    return entries


def _unreserved(name: str) -> str:
    """``name`` with as few of its leading ``_`` removed as webdataset needs to read its first
    path part as a sample's, not as metadata (``__background__/a`` -> ``_background__/a``,
    ``___x__/a`` -> ``_x__/a``)."""
    first = name.split("/", 1)[0]
    rest = name[len(first):]
    while is_metadata(first + rest):
        first = first[1:]
    return first + rest


def _class_prefix(name: str, classes: list[str]) -> str:
    """The first part of the keys of class folder ``name``: the name itself, except where
    webdataset would skip members under it (``__background__``): then without as many leading
    ``_`` as that takes."""
    new = _unreserved(f"{name}/x")[:-2]
    if new == name:
        return name
    taken = [c for c in classes if c != name and (c == new or _unreserved(f"{c}/x")[:-2] == new)]
    if taken:
        raise ValueError(f"class folders {name!r} and {taken[0]!r} both exist: webdataset skips "
                         f"members under {name}/, and keys under {new}/ are taken; rename "
                         "one of them")
    return new


def _unreadable(path: str) -> str | None:
    """Why the file at ``path`` cannot be read as an image file (a broken or looping symlink, a
    FIFO, device or socket), or None; the file is not opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        link = "a broken symlink" if os.path.islink(path) else "cannot be read"
        return f"{link} ({exc.strerror})"
    return None if stat.S_ISREG(mode) else _NOT_REGULAR


_NOT_REGULAR = "not a regular file"


def _read_regular(path: str) -> bytes:
    """The bytes of the regular file ``path``; anything else (a FIFO, whose opening would wait
    for a writer, a device, a socket) is refused without waiting."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: {_NOT_REGULAR} (a FIFO, device or socket)")
        return f.read()


def _class_keys(index: int, name: str, prefix: str, entries: list[tuple[str, str, str]],
                found: _Found) -> None:
    """Add the images among ``entries`` (of class folder ``name``) to ``found`` with their keys."""
    plain: dict[str, list[tuple[str, str, str]]] = {}  # wanted key -> (file name, ext, path)
    for rel, fname, path in entries:
        stem, dot, ext = fname.rpartition(".")
        if not (dot and stem and ext.lower() in IMAGE_EXTENSIONS):
            found.skipped.append(path)
            continue
        why = _unreadable(path)
        if why == _NOT_REGULAR:
            found.special.append(path)
            continue
        if why is not None:
            found.broken.append(f"{path}: {why}")
            continue
        head = f"{prefix}/{rel}/" if rel else f"{prefix}/"
        plain.setdefault(head + stem.replace(".", "_"), []).append((fname, ext, path))
    if not plain:
        found.empty.append(name)
    used: set[str] = set()
    chosen = []
    for key, files in plain.items():
        for fname, ext, path in files:
            want = key if len(files) == 1 else f"{key}_{ext.lower()}"
            final, n = want, 1
            while final in used or (final != key and final in plain):
                n += 1
                final = f"{want}-{n}"
            used.add(final)
            if final != key or prefix != name or "." in fname.rpartition(".")[0]:
                found.renamed.append((path, final))
            chosen.append((index, name, final, path))
    found.images.extend(sorted(chosen, key=lambda t: t[3]))


def _folder_images(root: str, classes: list[str]) -> _Found:
    """Every image file of an ImageFolder, and the files left out.

    Class folders are walked recursively (as torchvision's ``ImageFolder``), so ``cat/2021/a.jpg``
    becomes ``cat/2021/a``. WebDataset splits a member name at the first dot of its last
    component, so dots in a file's stem become ``_``; two files that would share a key
    (``x.jpg`` and ``x.png``) get their extension appended (``x_jpg``, ``x_png``) and, if
    still equal, a counter. A class folder whose name webdataset reserves (``__background__``)
    gives keys without its first ``_``. A class folder without an image is refused (as
    torchvision's ``ImageFolder`` does)."""
    found = _Found()
    tops = [os.path.join(root, name) for name in classes]
    seen = {_identity(p) for p in [root, *tops]}
    for index, (name, top) in enumerate(zip(classes, tops, strict=True)):
        _class_keys(index, name, _class_prefix(name, classes), _walk_class(top, found, seen),
                    found)
    if not found.images:
        raise ValueError(f"{root} has no image files in its class subfolders (by extension: "
                         f"{', '.join(sorted(IMAGE_EXTENSIONS))})")
    if found.empty:
        empty = found.empty
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        raise ValueError(f"class folder {os.path.join(root, empty[0])}{more} has no image files; "
                         "every class needs at least one (as torchvision's ImageFolder), so add "
                         "images or remove the folder")
    return found


def _folder_samples(images: list[tuple[int, str, str, str]]):
    for index, _name, key, path in images:
        data = _read_regular(path)
        ext = path.rpartition(".")[2].lower()
        yield {"__key__": key, ext: data, "cls": str(index).encode(), "__path__": path}


def _left_out_reasons(found: _Found) -> list[str]:
    """The reasons files were left out, each with its count, for the one line about them."""
    skipped, hidden, special, symlinks = found.skipped, found.hidden, found.special, found.symlinks
    why = []
    if hidden:
        why.append(f"{len(hidden)} hidden (name starting with '.')")
    if skipped:
        why.append(f"{len(skipped)} not an image by {'its' if len(skipped) == 1 else 'their'}"
                   " extension")
    if special:
        why.append(f"{len(special)} {_NOT_REGULAR}{'s' * (len(special) != 1)} (a FIFO, "
                   "device or socket, never opened)")
    if symlinks:
        why.append(f"{len(symlinks)} symlink{'s' * (len(symlinks) != 1)} (not followed)")
    return why


def _say_left_out(found: _Found, members: bool = False) -> None:
    """One line for the files left out (hidden, or not an image), one for the symlinked folders
    walked already, and one for keys that differ from file names (``members``: the names are
    those of a tar stream's files, not paths)."""
    skipped, hidden, renamed, special = found.skipped, found.hidden, found.renamed, found.special
    symlinks = found.symlinks
    if skipped or hidden or special or symlinks:
        n = len(skipped) + len(hidden) + len(special) + len(symlinks)
        noun = "file or folder" if n == 1 else "files or folders"
        if members or not any(os.path.isdir(p) for p in hidden):
            noun = "file" if n == 1 else "files"
        print(f"ember shards create: left out {n} {noun}: "
              f"{', '.join(_left_out_reasons(found))} "
              f"(first: {(hidden or skipped or special or symlinks)[0]})", file=sys.stderr)
    if found.loops:
        n = len(found.loops)
        print(f"ember shards create: left out {n} symlinked folder{'s' * (n != 1)} already walked "
              f"(a symlink loop, or a second link to a folder; each file is written once): "
              f"{', '.join(found.loops)}", file=sys.stderr)
    if renamed:
        n = len(renamed)
        path, key = renamed[0]
        print(f"ember shards create: {n} sample key{'s differ' if n != 1 else ' differs'} from "
              f"the file name{'s' * (n != 1)} (dots in a name, one name in two formats, or a "
              f"class name webdataset reserves; first: {path} -> key {key!r})", file=sys.stderr)


def _image_problem(data: bytes) -> str | None:
    """Why ``data`` is not an image Pillow can decode (within the pixel limit), or None."""
    import warnings as _warnings

    from PIL import Image

    try:
        with _warnings.catch_warnings():
            _warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > MAX_PIXELS:
                return f"{w}x{h} pixels is over the limit of {MAX_PIXELS}"
            img.load()
    except Image.UnidentifiedImageError:
        return "not an image Pillow can read"
    except Exception as exc:  # truncated or corrupt image data: Pillow raises many types
        return f"does not decode ({type(exc).__name__}: {exc})"
    return None


def _checked_images(samples, source: str, bad: list[str] | None = None):
    """The samples, each image field decoded once to prove it is an image (a text file named
    ``x.png`` is refused here instead of failing later in training); keys lose a leading
    ``./`` (as `tar cf - -C dir .` writes them). With ``bad`` (``--skip-bad``) a sample with a
    bad image is left out and described in ``bad`` instead."""
    for s in samples:
        if s["__key__"].startswith("./"):
            s = {**s, "__key__": s["__key__"][2:]}
        problem = None
        for k, v in s.items():
            if k[:2] != "__" and k.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
                problem = _image_problem(bytes(v))
                if problem is not None:
                    where = s.get("__path__") or (f"sample {s['__key__']!r} field {k!r} of "
                                                  f"{source}")
                    problem = f"{where}: {problem}"
                    break
        if problem is None:
            yield {k: v for k, v in s.items() if k != "__path__"}
        elif bad is None:
            raise ValueError(f"{problem}; remove it, or fix it, and run again (or pass --skip-bad)")
        else:
            bad.append(problem)


def _say_bad(bad: list[str]) -> None:
    if bad:
        n = len(bad)
        print(f"ember shards create: left out {n} bad image file{'s' * (n != 1)} (--skip-bad): "
              + "; ".join(bad), file=sys.stderr)


def _list_samples(list_file: str):
    """Files named in ``list_file`` (one relative path a line); files sharing a path up to the
    first dot of their name form one sample, in the order of the list."""
    base = os.path.dirname(os.path.abspath(list_file))
    with open(list_file, encoding="utf-8") as f:
        names = [line.strip() for line in f if line.strip()]
    current: dict | None = None
    for name in names:
        rel = name.replace("\\", "/")
        if os.path.isabs(name) or rel.startswith("../") or "/../" in rel:
            raise ValueError(f"{list_file}: {name!r} must be a path relative to the list's folder "
                             "(it becomes the sample's key)")
        folder, _, fname = rel.rpartition("/")
        stem, dot, ext = fname.partition(".")
        if not dot or not stem:
            raise ValueError(f"{list_file}: {name!r} has no extension to name its field")
        key = f"{folder}/{stem}" if folder else stem
        data = _read_regular(os.path.join(base, name))
        if current is not None and current["__key__"] == key:
            if ext in current:
                raise ValueError(f"{list_file}: {name!r} is listed twice")
            current[ext] = data
            continue
        if current is not None:
            yield current
        current = {"__key__": key, ext: data}
    if current is not None:
        yield current


def _check_write_flags(args, urls: list[str]) -> None:
    """Refuse bad -o, --maxcount, --maxsize and --post values before anything is read."""
    _check_output(args.output, urls)
    _check_out_folder(args.output)
    _count(args.maxcount)
    _byte_size(args.maxsize)
    _post(getattr(args, "post", None))


def _classes_file(args, data: bytes) -> dict[str, bytes]:
    """``classes.json`` (``data``) beside -o's shards, as an extra file of _write_all; refused
    where one naming other classes is there, unless --force."""
    out_dir = os.path.dirname(os.path.abspath(shard_path(args.output, 0)))
    path = os.path.join(out_dir, "classes.json")
    if os.path.exists(path) and not args.force:
        with open(path, "rb") as f:
            same = f.read() == data
        if not same:
            raise ValueError(f"{path} already exists and names other classes; pass --force to "
                             "replace it, or write to another folder")
    return {path: data}


def _folder_source(args, src: str, bad: list[str] | None):
    """The samples of an ImageFolder ``src`` (shuffled unless --no-shuffle), their number and
    the classes.json to write beside them. A file that cannot be read (a broken symlink) stops
    the command, or with ``bad`` (--skip-bad) is listed there."""
    if not os.path.isdir(src):
        raise ValueError(f"{src} is not a folder (ImageFolder layout: one subfolder per "
                         "class); use --list for a file of paths, or '-' for a tar stream on "
                         "standard input")
    tops = sorted(e for e in os.listdir(src) if os.path.isdir(os.path.join(src, e)))
    classes = [e for e in tops if not _hidden(e)]
    if not classes:
        raise ValueError(f"{src} has no class subfolders (ImageFolder layout)")
    _check_overwrite(args)  # refused before anything is said or read
    extra = _classes_file(args, json.dumps({"classes": classes}).encode("utf-8"))
    found = _folder_images(src, classes)
    found.hidden[:0] = [os.path.join(src, e) for e in tops if _hidden(e)]
    if found.broken and bad is None:
        raise ValueError(f"{found.broken[0]}; remove it, or fix it, and run again (or pass "
                         "--skip-bad)")
    _say_left_out(found)
    if bad is not None:
        bad.extend(found.broken)
    images = found.images
    if not args.no_shuffle:  # else a shard holds one or two classes, in folder order
        g = torch.Generator().manual_seed(0 if args.seed is None else args.seed)
        images = [images[i] for i in torch.randperm(len(images), generator=g).tolist()]
    return _folder_samples(images), len(images), extra


_LINKED_BYTES = 256 << 20  # the most bytes of earlier members kept for hard links to them


class _Linked:
    """The data of a tar stream's recent members, by name, for the hard links that follow them
    (as tar extraction gives a hard link its target's data)."""

    def __init__(self):
        self.kept: dict[str, bytes] = {}
        self.size = 0
        self.dropped: set[str] = set()

    def add(self, name: str, data: bytes) -> None:
        self.size += len(data) - len(self.kept.pop(name, b""))
        self.kept[name] = data
        self.dropped.discard(name)
        while self.size > _LINKED_BYTES:
            old = next(iter(self.kept))
            self.size -= len(self.kept.pop(old))
            self.dropped.add(old)

    def data(self, name: str, target: str) -> bytes:
        while target.startswith("./"):
            target = target[2:]
        if target in self.kept:
            return self.kept[target]
        if target in self.dropped:
            raise ValueError(f"standard input: the hard link {name} -> {target} points too far "
                             "back in the stream to be kept; make the stream with tar "
                             "--hard-dereference")
        raise ValueError(f"standard input: the hard link {name} -> {target} names no earlier "
                         "member of the stream")


def _stream_members(members, found: _Found):
    """The members of a tar stream as ``create FOLDER`` would name them: without a leading
    ``./``, hidden files and folders left out (in ``found.hidden``), and a first path part that
    webdataset reserves (``__background__``) without its first ``_`` (in ``found.renamed``).
    A hard link takes its target's data; a symlink is left out (in ``found.symlinks``)."""
    plain: set[str] = set()  # first path parts as they are
    moved: dict[str, str] = {}  # reserved first path part -> the one written
    linked = _Linked()
    for name, data, offset in members:
        while name.startswith("./"):
            name = name[2:]
        if not name:
            continue
        if isinstance(data, Link):
            if not data.hard:
                found.symlinks.append(name)
                continue
            data = linked.data(name, data.target)
        elif data is not None:
            linked.add(name, data)
        if unsafe_name(name):  # refused where samples are grouped, as absolute names are
            yield name, data, offset
            continue
        if any(_hidden(part) for part in name.split("/")):
            found.hidden.append(name)
            continue
        first = name.split("/", 1)[0]
        if is_metadata(name):
            original, name = name, _unreserved(name)
            moved[first] = name.split("/", 1)[0]
            key = (split_name(name) or (name, ""))[0]
            if not found.renamed or found.renamed[-1][1] != key:  # one entry per sample
                found.renamed.append((original, key))
        else:
            plain.add(first)
        for m, n in moved.items():
            other = next((m2 for m2, n2 in moved.items() if m2 != m and n2 == n),
                         n if n in plain else None)
            if other is not None:
                raise ValueError(f"class folders {m!r} and {other!r} both exist: webdataset "
                                 f"skips members under {m}/, and keys under {n}/ are taken; "
                                 "rename one of them")
        yield name, data, offset


def _stream_samples(stream, found: _Found):
    """The samples of a tar stream (standard input), named as :func:`_stream_members` says."""
    src = open_tar_source(stream, "-")
    try:
        count = 0
        for sample in group_samples(_stream_members(iter_members(src, "-", links=True), found),
                                    "-"):
            count += 1
            yield sample
        src.finish()  # after the last sample: a gzip trailer cut short is an error too
        if not count:  # as a folder without images is refused
            left = len(found.hidden) + len(found.symlinks)
            raise ValueError("standard input holds no samples (no file member with an extension"
                             + (f"; {left} hidden or symlinked members left out" if left else "")
                             + ")")
    finally:
        src.close()


def _check_order_flags(args) -> None:
    """Refuse --seed and --no-shuffle where they cannot mean anything."""
    if args.source == "-" or args.list:
        given = "--seed" if args.seed is not None else "--no-shuffle" if args.no_shuffle else None
        if given is not None:
            raise ValueError(f"{given} orders the samples of a folder; "
                             f"{'a list' if args.list else 'a stream'} is written in its own "
                             "order")
    elif args.no_shuffle and args.seed is not None:
        raise ValueError("--seed sets the shuffled order and --no-shuffle keeps folder order: "
                         "pass one of them")


def _create(args) -> int:
    src = args.source
    _check_order_flags(args)
    _check_write_flags(args, [])
    bad: list[str] | None = [] if args.skip_bad else None
    if src == "-":  # a tar stream on standard input, named as from a folder
        found = _Found()
        with _progress(_stream_samples(sys.stdin.buffer, found), args, unit="sample") as bar:
            code = _write_all(args, ["-"], _checked_images(bar, "standard input", bad),
                              join=True)
        _say_left_out(found, members=True)
        _say_bad(bad or [])
        return code
    extra = None
    total = None
    if args.list:
        if not os.path.isfile(src):
            raise ValueError(f"--list {src}: not a file")
        _check_overwrite(args)  # refused before anything is said or read
        samples = _list_samples(src)
    else:
        samples, total, extra = _folder_source(args, src, bad)
    with _progress(samples, args, unit="sample", total=total) as bar:  # bad ones counted too
        code = _write_all(args, [], _checked_images(bar, src, bad), extra=extra)
    _say_bad(bad or [])
    return code


def _index(args) -> int:
    urls = _urls(args)
    _no_stdin(urls, "index writes .idx files next to local shard files")
    with _progress(urls, args) as bar:
        for url in bar:
            path = write_index(url, _options(args))
            with open(path) as f:
                n = len(json.load(f)["samples"])
            print(f"{path} {n} samples")
    return 0


_WRITERS = ("split", "merge", "shuffle", "create")  # the actions that write shards (-o)


def _any_outputs(pattern: str) -> bool:
    """Whether shards (or .idx files) of ``pattern`` are there (False for a bad pattern)."""
    try:
        return bool(_existing_outputs(pattern))
    except ValueError:
        return False


def _quiet_stdout() -> None:
    """Point standard output at the null device, so that nothing more (the flush at the exit)
    is written into a pipe that was closed."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (tests swap it for a buffer)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _one_line_warning(name: str) -> Callable:
    """A ``warnings.showwarning`` that says a warning as the CLI's other notes: one line."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"ember shards {name}: {' '.join(str(message).split())}", file=sys.stderr)

    return show


def _guarded(name: str, fn: Callable) -> Callable:
    """Run ``fn(args)``, turning bad input (a shard error, a bad argument) into a one-line
    message and exit status 2 instead of a traceback."""

    def run(args) -> int:
        try:
            with _stop_signals_raise(), warnings.catch_warnings():
                warnings.showwarning = _one_line_warning(name)
                code = fn(args)
                if sys.stdout is not None and not sys.stdout.closed:  # `>&-`: None, quietly
                    sys.stdout.flush()  # a closed pipe is found here, not at the exit
                return code
        except BrokenPipeError:  # `ember shards cat ... | head`: quiet, as Unix tools are
            _quiet_stdout()
            return 128 + getattr(signal, "SIGPIPE", 13)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: one line, the signal's status
            if name not in _WRITERS:
                what = ""
            elif getattr(args, "written", False):
                what = f"; the new shards of -o {args.output} were written"
            elif args.force and _any_outputs(args.output):
                what = "; nothing was written, the earlier shards are unchanged"
            else:
                what = "; nothing was written"
            print(f"ember shards {name}: interrupted{what}", file=sys.stderr)
            return 128 + exc.signum if isinstance(exc, _Stopped) else 130
        except (ShardError, ValueError, OSError, ImportError) as exc:
            # in the command's own terms: the flag, not the Python argument
            message = " ".join(str(exc).replace("pass allow_pipe=True", "pass --allow-pipe")
                               .split())
            print(f"ember shards {name}: error: {message}", file=sys.stderr)
            return 2

    return run


def register(subparsers) -> None:
    """Add the ``shards`` sub-command to the ``ember`` command line."""
    p = subparsers.add_parser("shards", help="inspect and re-shard WebDataset tar shards")
    p.set_defaults(func=lambda args: p.print_help(sys.stderr) or 2)  # no action: a usage error
    sub = p.add_subparsers(dest="shards_command", metavar="ACTION")
    for name, fn, hlp in [("ls", _ls, "sample count of every shard (from .idx files if present)"),
                          ("cat", _cat, "print samples"),
                          ("stats", _stats, "samples, bytes, extensions per shard"),
                          ("verify", _verify, "parse every shard, report corrupt ones and .idx "
                           "files that no longer match"),
                          ("split", _reshard, "re-shard into smaller shards"),
                          ("merge", _reshard, "re-shard into fewer shards"),
                          ("shuffle", _shuffle, "shuffle samples into new shards"),
                          ("index", _index, "write .idx files next to local shards"),
                          ("create", _create, "write shards from an image folder (ImageFolder "
                           "layout) or a list of files")]:
        q = sub.add_parser(name, help=hlp)
        if name == "create":
            q.add_argument("source", help="a folder with one subfolder per class, with --list "
                           "a text file of relative paths, or '-': a tar stream on standard "
                           "input")
            q.add_argument("--list", action="store_true", help="SOURCE is a file list")
        elif name in ("index", "shuffle"):  # they read shards by byte offset: files only
            q.add_argument("urls", nargs="+", help="shard paths or URLs; brace patterns expand"
                           + ("" if name == "index" else " (a global shuffle needs local "
                              "shards; --buffer N takes any URLs)"))
        else:
            q.add_argument("urls", nargs="+", help="shard paths or URLs; brace patterns expand; "
                           "'-' reads a tar stream from standard input")
        q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        if name in ("cat", "stats"):
            q.add_argument("--json", action="store_true")
        if name == "cat":
            q.add_argument("-n", type=int, default=None, help="at most N samples")
            q.add_argument("--values", action="store_true", help="print values, not sizes")
            q.add_argument("--tar", action="store_true", help="write the samples as one tar "
                           "stream to standard output (e.g. to pipe into `split -`)")
        q.add_argument("--allow-pipe", action="store_true", help="allow pipe:CMD URLs")
        if name in ("split", "merge", "shuffle", "create"):
            q.add_argument("-o", "--output", required=True, help="pattern, e.g. out-%%06d.tar")
            q.add_argument("--maxcount", default="100000", metavar="N",
                           help="samples per shard (default: %(default)s)")
            q.add_argument("--maxsize", default="3GB", metavar="SIZE",
                           help="bytes per shard, with an optional unit: 500MB, 1GB, 1GiB "
                           "(default: 3GB)")
            q.add_argument("--force", action="store_true", help="replace shards (and .idx "
                           "files) of the output pattern that already exist; all or nothing: a "
                           "failed or interrupted run leaves them as they were")
            q.add_argument("--post", default=None, help="command run on each new shard once "
                           "all are written, checked and in place ({} is its path; e.g. 'aws s3 "
                           "cp {} s3://bucket/'); a failure stops and puts the old files back")
        if name == "create":
            q.add_argument("--seed", type=int, default=None, help="seed of the order of the "
                           "samples of a folder, shuffled over the shards (default: 0)")
            q.add_argument("--no-shuffle", action="store_true", help="keep a folder's samples "
                           "in folder order (each shard then holds one or two classes)")
            q.add_argument("--skip-bad", action="store_true", help="leave out images that do "
                           "not decode and list them at the end, instead of stopping at the "
                           "first")
        if name == "shuffle":
            q.add_argument("--seed", type=int, default=0)
            q.add_argument("--buffer", type=int, default=0,
                           help="shuffle through a buffer of N samples (any URLs); 0: a global "
                           "shuffle (local shards)")
        q.set_defaults(func=_guarded(name, fn))


if __name__ == "__main__":  # python -m ember.shards.cli ...: `ember shards ...` (the layer below
    # the ember command cannot import it, docs/architecture.md)
    import argparse

    _parser = argparse.ArgumentParser(prog="ember")
    register(_parser.add_subparsers(dest="command", metavar="COMMAND"))
    _args = _parser.parse_args(["shards", *sys.argv[1:]])
    sys.exit(int(_args.func(_args) or 0))
