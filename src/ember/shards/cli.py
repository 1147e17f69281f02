"""``ember shards``: inspect, verify and re-shard WebDataset-format tar shards.

Sub-commands: ``ls`` (samples per shard), ``cat`` (print samples), ``stats`` (samples, bytes and
extensions per shard), ``verify`` (parse every shard, report corrupt ones; exit 1 if any),
``split`` / ``merge`` / ``shuffle`` (re-shard into a new numbered series), ``index`` (write
``.idx`` files next to local shards).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from collections.abc import Iterator

__all__ = ["register"]


def _progress(iterable, total: int | None, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="shard", disable=quiet, file=sys.stderr,
                leave=False)


def _options(args):
    from ember.shards.urls import UrlOptions

    return UrlOptions(allow_pipe=getattr(args, "allow_pipe", False),
                      s3_endpoint=getattr(args, "s3_endpoint", None))


def _urls(args) -> list[str]:
    from ember.shards.urls import expand_urls

    urls = expand_urls(list(args.urls))
    if not urls:
        raise SystemExit("ember shards: no shards given")
    return urls


def _samples(urls: list[str], options, quiet: bool, desc: str) -> Iterator[dict]:
    from ember.shards.dataset import iter_shard

    for url in _progress(urls, len(urls), desc, quiet):
        yield from iter_shard(url, options)


def _fields(sample: dict) -> list[str]:
    return sorted(k for k in sample if k[:2] != "__")


def _cmd_ls(args) -> int:
    from ember.shards.index import sample_count

    options = _options(args)
    total = 0
    for url in _urls(args):
        n = sample_count(url, options)
        total += n
        print(f"{n}\t{url}")
    print(f"{total}\ttotal")
    return 0


def _show(value: bytes, limit: int) -> str:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return f"<{len(value)} bytes>"
    if len(text) > limit:
        text = text[:limit] + "..."
    return json.dumps(text)


def _cmd_cat(args) -> int:
    options = _options(args)
    for shown, sample in enumerate(_samples(_urls(args), options, True, "cat")):
        if args.limit is not None and shown >= args.limit:
            break
        fields = _fields(sample)
        if args.json:
            row = {"__key__": sample["__key__"], "__url__": sample["__url__"]}
            for ext in fields:
                row[ext] = _show(sample[ext], args.width) if args.values else len(sample[ext])
            print(json.dumps(row))
        else:
            parts = [f"{ext}={_show(sample[ext], args.width) if args.values else len(sample[ext])}"
                     for ext in fields]
            print(sample["__key__"] + "\t" + " ".join(parts))
    return 0


def _cmd_stats(args) -> int:
    from ember.shards.dataset import iter_shard

    options = _options(args)
    urls = _urls(args)
    rows = []
    for url in _progress(urls, len(urls), "stats", args.quiet):
        n, nbytes, exts = 0, 0, Counter()
        for sample in iter_shard(url, options):
            n += 1
            for ext in _fields(sample):
                exts[ext] += 1
                nbytes += len(sample[ext])
        rows.append({"url": url, "samples": n, "bytes": nbytes, "extensions": dict(sorted(exts.items()))})
    total = {"shards": len(rows), "samples": sum(r["samples"] for r in rows),
             "bytes": sum(r["bytes"] for r in rows), "extensions": {}}
    for r in rows:
        for ext, c in r["extensions"].items():
            total["extensions"][ext] = total["extensions"].get(ext, 0) + c
    if args.json:
        print(json.dumps({"shards": rows, "total": total}))
        return 0
    for r in rows:
        ext = ",".join(f"{k}:{v}" for k, v in r["extensions"].items())
        print(f"{r['samples']}\t{r['bytes']}\t{ext}\t{r['url']}")
    ext = ",".join(f"{k}:{v}" for k, v in sorted(total["extensions"].items()))
    print(f"{total['samples']}\t{total['bytes']}\t{ext}\ttotal ({total['shards']} shards)")
    return 0


def _cmd_verify(args) -> int:
    from ember.shards.dataset import iter_shard
    from ember.shards.errors import ShardError

    options = _options(args)
    urls = _urls(args)
    bad = 0
    samples = 0
    for url in _progress(urls, len(urls), "verify", args.quiet):
        try:
            for _ in iter_shard(url, options):
                samples += 1
        except ShardError as exc:
            bad += 1
            print(f"CORRUPT\t{exc}")
        except OSError as exc:
            bad += 1
            print(f"CORRUPT\tshard {url}: {exc}")
    print(f"{len(urls) - bad} of {len(urls)} shards ok, {samples} samples read, {bad} corrupt")
    return 1 if bad else 0


def _writer(args):
    from ember.shards.writer import ShardWriter

    return ShardWriter(args.output, maxcount=args.maxcount, maxsize=args.maxsize,
                       index=args.index, encode=False)


def _reshard(args, samples: Iterator[dict]) -> int:
    with _writer(args) as w:
        for sample in samples:
            w.write({k: v for k, v in sample.items() if k != "__url__"})
    print(f"wrote {w.total} samples to {len(w.shards)} shards")
    for path in w.shards:
        print(path)
    return 0


def _cmd_split(args) -> int:
    return _reshard(args, _samples(_urls(args), _options(args), args.quiet, "split"))


def _cmd_merge(args) -> int:
    return _reshard(args, _samples(_urls(args), _options(args), args.quiet, "merge"))


def _cmd_shuffle(args) -> int:
    """A full shuffle of the samples (held in memory; use --buffer for a bounded buffer)."""
    rng = random.Random(args.seed)
    urls = _urls(args)
    rng.shuffle(urls)
    src = _samples(urls, _options(args), args.quiet, "shuffle")
    if args.buffer is None:
        items = list(src)
        rng.shuffle(items)
        return _reshard(args, iter(items))

    def buffered() -> Iterator[dict]:
        buf: list[dict] = []
        for sample in src:
            buf.append(sample)
            if len(buf) >= args.buffer:
                i = rng.randrange(len(buf))
                buf[i], buf[-1] = buf[-1], buf[i]
                yield buf.pop()
        rng.shuffle(buf)
        yield from buf

    return _reshard(args, buffered())


def _cmd_index(args) -> int:
    from ember.shards.index import write_index

    options = _options(args)
    urls = _urls(args)
    for url in _progress(urls, len(urls), "index", args.quiet):
        out = write_index(url, options)
        if not args.quiet:
            print(out)
    return 0


def register(subparsers) -> None:
    """Add ``ember shards`` and its sub-commands to the ``ember`` parser."""
    p = subparsers.add_parser("shards", help="inspect, verify and re-shard WebDataset tar shards",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="shards_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1])

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.add_argument("urls", nargs="+", help="shards: paths, URLs or brace patterns")
        sp.add_argument("--allow-pipe", action="store_true", help="allow pipe:CMD URLs")
        sp.add_argument("--s3-endpoint", default=None, help="endpoint URL for s3:// shards")
        sp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        sp.set_defaults(func=fn)
        return sp

    add("ls", _cmd_ls, "samples per shard (from index files when present)")
    sp = add("cat", _cmd_cat, "print each sample's key and fields")
    sp.add_argument("-n", "--limit", type=int, default=None, help="stop after this many samples")
    sp.add_argument("--values", action="store_true", help="print field values (text), not sizes")
    sp.add_argument("--width", type=int, default=60, help="truncate values to this many characters")
    sp.add_argument("--json", action="store_true", help="one JSON object per sample")
    sp = add("stats", _cmd_stats, "samples, bytes and extensions per shard")
    sp.add_argument("--json", action="store_true", help="print JSON")
    add("verify", _cmd_verify, "parse every shard and report corrupt ones (exit status 1 if any)")
    for name, fn, help in (("split", _cmd_split, "re-shard into smaller shards"),
                           ("merge", _cmd_merge, "concatenate shards into fewer, larger shards"),
                           ("shuffle", _cmd_shuffle, "re-shard with the samples in a random order")):
        sp = add(name, fn, help)
        sp.add_argument("-o", "--output", required=True,
                        help="output pattern, e.g. 'out/train-%%06d.tar'")
        sp.add_argument("--maxcount", type=int, default=100_000, help="samples per output shard")
        sp.add_argument("--maxsize", type=float, default=3e9, help="bytes per output shard")
        sp.add_argument("--index", action="store_true", help="write .idx files for the output")
        if name == "shuffle":
            sp.add_argument("--seed", type=int, default=0, help="shuffle seed")
            sp.add_argument("--buffer", type=int, default=None,
                            help="shuffle through a buffer of this many samples instead of memory")
    add("index", _cmd_index, "write a .idx index next to each local shard")
