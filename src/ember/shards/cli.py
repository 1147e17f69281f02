"""The ``ember shards`` command: ls, cat, stats, verify, split, merge, shuffle, index."""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from ember.shards.dataset import iter_shard
from ember.shards.errors import ShardError
from ember.shards.index import build_index, read_sample, sample_count, write_index
from ember.shards.urls import UrlOptions, expand_urls
from ember.shards.writer import ShardWriter

__all__ = ["register"]


def _urls(args) -> list[str]:
    return expand_urls(args.urls)


def _ls(args) -> int:
    total = 0
    for url in _urls(args):
        n = sample_count(url)
        total += n
        print(f"{n}\t{url}")
    print(f"{total}\ttotal")
    return 0


def _text(v: bytes) -> str:
    return bytes(v).decode("utf-8", "replace")


def _cat(args) -> int:
    left = args.n
    for url in _urls(args):
        for s in iter_shard(url, UrlOptions(allow_pipe=args.allow_pipe)):
            if left is not None and left <= 0:
                return 0
            if left is not None:
                left -= 1
            fields = {k: (json.dumps(_text(v)) if args.values else len(v))
                      for k, v in s.items() if k[:2] != "__"}
            if args.json:
                print(json.dumps({"__key__": s["__key__"], **fields}))
            else:
                print(s["__key__"], " ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


def _stats(args) -> int:
    rows, total = [], {"samples": 0, "bytes": 0, "extensions": {}}
    for url in tqdm(_urls(args), disable=args.quiet):
        n, size, exts = 0, 0, {}
        for s in iter_shard(url):
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


def _verify(args) -> int:
    urls = _urls(args)
    bad = samples = 0
    for url in tqdm(urls, disable=args.quiet):
        try:
            samples += sum(1 for _ in iter_shard(url))
        except ShardError as exc:
            bad += 1
            print(f"CORRUPT {exc}")
    print(f"{len(urls) - bad} of {len(urls)} shards ok, {samples} samples read, {bad} corrupt")
    return 1 if bad else 0


def _reshard(args, order=None) -> int:
    urls = _urls(args)
    with ShardWriter(args.output, maxcount=args.maxcount, maxsize=args.maxsize,
                     encode=False) as w:
        if order is None:
            for url in tqdm(urls, disable=args.quiet):
                for s in iter_shard(url):
                    w.write({k: v for k, v in s.items() if k != "__url__"})
        else:
            for url, span in tqdm(order, disable=args.quiet):
                s = read_sample(url, span)
                w.write({k: v for k, v in s.items() if k != "__url__"})
    print(f"wrote {w.total} samples to {len(w.shards)} shards")
    return 0


def _shuffle(args) -> int:
    if args.buffer:
        from ember.shards.dataset import ShardDataset

        ds = ShardDataset(args.urls, seed=args.seed).shuffle(args.buffer)
        with ShardWriter(args.output, maxcount=args.maxcount, maxsize=args.maxsize,
                         encode=False) as w:
            for s in ds:
                w.write({k: v for k, v in s.items() if k != "__url__"})
        print(f"wrote {w.total} samples to {len(w.shards)} shards")
        return 0
    spans = [(u, (s, e)) for u in _urls(args) for _, s, e in build_index(u)["samples"]]
    g = torch.Generator().manual_seed(args.seed)
    order = [spans[i] for i in torch.randperm(len(spans), generator=g).tolist()]
    return _reshard(args, order)


def _index(args) -> int:
    for url in tqdm(_urls(args), disable=args.quiet):
        path = write_index(url)
        print(f"{path} {sample_count(url)} samples")
    return 0


def register(subparsers) -> None:
    """Add the ``shards`` sub-command to the ``ember`` command line."""
    p = subparsers.add_parser("shards", help="inspect and re-shard WebDataset tar shards")
    p.set_defaults(func=lambda args: p.print_help() or 0)
    sub = p.add_subparsers(dest="shards_command", metavar="ACTION")
    for name, fn, hlp in [("ls", _ls, "list shard URLs"), ("cat", _cat, "print samples"),
                          ("stats", _stats, "samples, bytes, extensions per shard"),
                          ("verify", _verify, "parse every shard, report corrupt ones"),
                          ("split", _reshard, "re-shard into smaller shards"),
                          ("merge", _reshard, "re-shard into fewer shards"),
                          ("shuffle", _shuffle, "globally shuffle samples into new shards"),
                          ("index", _index, "write .idx files")]:
        q = sub.add_parser(name, help=hlp)
        q.add_argument("urls", nargs="+")
        q.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        if name in ("cat", "stats"):
            q.add_argument("--json", action="store_true")
        if name == "cat":
            q.add_argument("-n", type=int, default=None, help="at most N samples")
            q.add_argument("--values", action="store_true", help="print values, not sizes")
        q.add_argument("--allow-pipe", action="store_true")
        if name in ("split", "merge", "shuffle"):
            q.add_argument("-o", "--output", required=True, help="pattern, e.g. out-%%06d.tar")
            q.add_argument("--maxcount", type=int, default=100_000)
            q.add_argument("--maxsize", type=float, default=3e9)
            q.add_argument("--seed", type=int, default=0)
            q.add_argument("--buffer", type=int, default=0, help="shuffle: buffer (0: global)")
        q.set_defaults(func=fn)


if __name__ == "__main__":
    from ember.cli import main

    sys.exit(main(["shards", *sys.argv[1:]]))
