"""Benchmark ember.shards against the webdataset package on the same shards, in one process.

Measures read samples/s and MB/s (1 KB, 10 KB, 100 KB samples; 0 and 2 DataLoader workers; no
decoding; with workers ember reads through ShardLoader (groups of 128, large values through
shared memory) and webdataset through ``DataLoader(batch_size=None)``, each library's documented
way; ``floor/s`` is that DataLoader
fed ready-made samples, the per-sample transfer ceiling), the raw read ceiling of
``cat shards > /dev/null`` on the same files, and writer throughput. Every measurement is
repeated ``--repeat`` times, round robin (cat, ember, webdataset, cat, ...; for writes ember,
webdataset, ember, ...) so that load from other jobs hits all alike, and the best run of each is
kept. The page cache is warmed by
one untimed cat first; the time cat takes to start and exit with no data is subtracted from its
runs, so the ceiling is the read itself. Prints a table and writes bench/results/shards.json
(or ``--out``). ``--quick`` uses a quarter of the samples; its 2-worker rows are then dominated
by worker start-up (about 1.4x webdataset at 100 KB against about 5x in a full run), so judge the
goals on a full run.

A second table compares loader features with plain local reading in the same process (0
workers): the second epoch of shards served over HTTP on 127.0.0.1 and read through
``cache_dir=`` (goal: at least 90% of local reading), and ``resampled=True`` streams cut with
``with_epoch`` (goal: the same samples/s as plain reading).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ember.shards import ShardDataset, ShardLoader, ShardWriter, tar

SIZES = {"1KB": (1000, 40000), "10KB": (10_000, 20000), "100KB": (100_000, 4000)}
WORKERS = (0, 2)


def _write(cls, pattern: str, n: int, payload: bytes, **kw) -> float:
    """Samples/s writing ``n`` samples of ``payload`` into four shards."""
    t = time.perf_counter()
    with cls(pattern, maxcount=max(1, n // 4), **kw) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:08d}", "bin": payload, "cls": b"1"})
    return n / (time.perf_counter() - t)


class _Prebuilt(IterableDataset):
    """``n`` ready-made samples shaped like the shards' (split over workers): what a DataLoader
    costs per sample with no reading at all, the ceiling for any reader with workers."""

    def __init__(self, n: int, payload: bytes, url: str):
        self.n, self.payload, self.url = n, payload, url

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, workers):
            yield {"__key__": f"k{i:08d}", "__url__": self.url, "bin": self.payload, "cls": b"1"}


def _read(ds, workers: int, expected: int) -> float:
    """Seconds to iterate ``ds`` as its users would: an ember ShardDataset through ShardLoader
    (its default grouped transfer) if ``workers``, anything else through
    ``DataLoader(batch_size=None)`` (webdataset's idiom: per-sample transfer); checking the count."""
    t = time.perf_counter()
    if workers and isinstance(ds, ShardDataset):
        n = sum(1 for _ in ShardLoader(ds, num_workers=workers))
    elif workers:
        n = sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=workers))
    else:
        n = sum(1 for _ in ds)
    dt = time.perf_counter() - t
    if n != expected:
        raise RuntimeError(f"read {n} samples, expected {expected}")
    return dt


def _cat(files: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


_COLUMNS = [  # (heading, row key, scale, width)
    ("case", "case", None, 18),
    ("ember/s", "ember_sps", 1, 9),
    ("wds/s", "wds_sps", 1, 8),
    ("x wds", "ratio", 1, 6),
    ("floor/s", "floor_sps", 1, 8),
    ("ember MB/s", "ember_MBps", 1, 10),
    ("wds MB/s", "wds_MBps", 1, 9),
    ("cat MB/s", "cat_MBps", 1, 9),
    ("% cat", "of_cat", 100, 6),
]


def _table(rows: list[dict]) -> str:
    """The rows as a text table; blank where a measurement does not apply."""
    lines = [" ".join(f"{h:{w}}" if s is None else f"{h:>{w}}" for h, _, s, w in _COLUMNS)]
    for r in rows:
        cells = []
        for _, key, scale, width in _COLUMNS:
            value = r.get(key)
            if scale is None:
                cells.append(f"{value:{width}}")
            elif value is None:
                cells.append(" " * width)
            else:
                digits = 2 if key == "ratio" else 1 if key == "of_cat" else 0
                cells.append(f"{value * scale:{width}.{digits}f}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


@functools.cache
def _server(directory: str) -> str:
    """An HTTP server on 127.0.0.1 serving ``directory`` (for the life of the process)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=directory)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def _features(d: str, label: str, files: list[str], n: int, repeat: int) -> list[dict]:
    """cache_dir second epoch and resampled streams against plain local reading (0 workers)."""
    base = _server(d)
    urls = [f"{base}/{os.path.basename(f)}" for f in files]
    cache = tempfile.mkdtemp(dir=d)
    _read(ShardDataset(urls, shuffle_shards=False, cache_dir=cache), 0, n)  # epoch 1 fills it
    local, cached, resampled = [], [], []
    for _ in range(repeat):
        local.append(_read(ShardDataset(files, shuffle_shards=False), 0, n))
        cached.append(_read(ShardDataset(urls, shuffle_shards=False, cache_dir=cache), 0, n))
        resampled.append(_read(ShardDataset(files, resampled=True).with_epoch(n), 0, n))
    tl = min(local)
    return [{"case": f"cache_dir 2nd epoch {label}", "feature_sps": n / min(cached),
             "local_sps": n / tl, "ratio": tl / min(cached), "goal": 0.9},
            {"case": f"resampled {label}", "feature_sps": n / min(resampled),
             "local_sps": n / tl, "ratio": tl / min(resampled), "goal": 1.0}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the samples")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "shards.json")
    args = ap.parse_args()
    import webdataset as wds

    warnings.filterwarnings("ignore")
    sizes = {k: (s, n // 4 if args.quick else n) for k, (s, n) in SIZES.items()}
    rows, features = [], []
    with tempfile.TemporaryDirectory() as d:
        spawn = min(_cat(["/dev/null"]) for _ in range(5))  # cat start-up and exit alone
        for label, (size, n) in sizes.items():
            payload = os.urandom(size)
            we = ww = 0.0
            for _ in range(args.repeat):  # round robin, best kept, as for reads
                we = max(we, _write(ShardWriter, f"{d}/{label}-e-%03d.tar", n, payload))
                ww = max(ww, _write(wds.ShardWriter, f"{d}/{label}-w-%03d.tar", n, payload,
                                    verbose=0))
            rows.append({"case": f"write {label}", "ember_sps": we, "wds_sps": ww, "ratio": we / ww})
            files = sorted(str(p) for p in Path(d).glob(f"{label}-e-*.tar"))
            mb = sum(os.path.getsize(f) for f in files) / 1e6
            _cat(files)  # warm the page cache
            for workers in WORKERS:
                cat, ember, web, floor = [], [], [], []
                for _ in range(args.repeat):
                    cat.append(max(_cat(files) - spawn, 1e-9))
                    ember.append(_read(ShardDataset(files, shuffle_shards=False), workers, n))
                    web.append(_read(wds.WebDataset(files, shardshuffle=False), workers, n))
                    if workers:
                        floor.append(_read(_Prebuilt(n, payload, files[0]), workers, n))
                te, tw, tc = min(ember), min(web), min(cat)
                rows.append(
                    {
                        "case": f"read {label} w={workers}",
                        "ember_sps": n / te,
                        "wds_sps": n / tw,
                        "ratio": tw / te,
                        "ember_MBps": mb / te,
                        "wds_MBps": mb / tw,
                        "cat_MBps": mb / tc,
                        "of_cat": tc / te,
                    }
                )
                if floor:
                    rows[-1]["floor_sps"] = n / min(floor)
            features.extend(_features(d, label, files, n, args.repeat))
    print(_table(rows))
    print()
    print(f"{'feature (0 workers)':28} {'feature/s':>10} {'local/s':>10} {'ratio':>6} {'goal':>5}")
    for r in features:
        print(f"{r['case']:28} {r['feature_sps']:10.0f} {r['local_sps']:10.0f} "
              f"{r['ratio']:6.2f} {r['goal']:5.2f}")
    print(f"compiled tar scan and grouping: {'yes' if tar._scan is not None else 'no (pure Python)'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "quick": args.quick,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "cat_spawn_s": spawn,
        "compiled_speedups": tar._scan is not None,
        "samples": {k: n for k, (_, n) in sizes.items()},
    }
    args.out.write_text(json.dumps({**meta, "rows": rows, "features": features}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
