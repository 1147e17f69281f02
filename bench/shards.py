"""Benchmark ember.shards against the webdataset package on the same shards, in one process.

Measures read samples/s and MB/s (1 KB, 10 KB, 100 KB samples; 0 and 2 DataLoader workers; no
decoding), the raw `cat shards > /dev/null` ceiling, and writer throughput. Prints a table and
writes bench/results/shards.json. ``--quick`` uses fewer samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from torch.utils.data import DataLoader

from ember.shards import ShardDataset, ShardWriter


def _write(cls, pattern, n, payload, **kw):
    t = time.perf_counter()
    with cls(pattern, maxcount=max(1, n // 4), **kw) as w:
        for i in range(n):
            w.write({"__key__": f"k{i:08d}", "bin": payload, "cls": b"1"})
    return n / (time.perf_counter() - t)


def _read(ds, workers):
    t = time.perf_counter()
    if workers:
        n = sum(1 for _ in DataLoader(ds, batch_size=None, num_workers=workers))
    else:
        n = sum(1 for _ in ds)
    return n, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import webdataset as wds

    warnings.filterwarnings("ignore")
    sizes = {"1KB": (1000, 40000), "10KB": (10_000, 20000), "100KB": (100_000, 4000)}
    if args.quick:
        sizes = {k: (s, n // 4) for k, (s, n) in sizes.items()}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for label, (size, n) in sizes.items():
            payload = os.urandom(size)
            we = _write(ShardWriter, f"{d}/{label}-e-%03d.tar", n, payload)
            ww = _write(wds.ShardWriter, f"{d}/{label}-w-%03d.tar", n, payload, verbose=0)
            rows.append({"case": f"write {label}", "ember_sps": we, "wds_sps": ww,
                         "ratio": we / ww})
            files = sorted(str(p) for p in Path(d).glob(f"{label}-e-*.tar"))
            nbytes = sum(os.path.getsize(f) for f in files)
            t = time.perf_counter()
            if sys.platform != "win32":
                subprocess.run("cat " + " ".join(files) + " > /dev/null", shell=True, check=True)
            cat_mbs = nbytes / 1e6 / (time.perf_counter() - t)
            for workers in (0, 2):
                _, te = _read(ShardDataset(files, shuffle_shards=False), workers)
                _, tw = _read(wds.WebDataset(files, shardshuffle=False), workers)
                rows.append({"case": f"read {label} w={workers}", "ember_sps": n / te,
                             "wds_sps": n / tw, "ratio": tw / te,
                             "ember_MBps": nbytes / 1e6 / te, "wds_MBps": nbytes / 1e6 / tw,
                             "cat_MBps": cat_mbs, "of_cat": nbytes / 1e6 / te / cat_mbs})
    print(f"{'case':18} {'ember/s':>10} {'wds/s':>10} {'x wds':>6} {'ember MB/s':>10} "
          f"{'cat MB/s':>9} {'% cat':>6}")
    for r in rows:
        print(f"{r['case']:18} {r['ember_sps']:10.0f} {r['wds_sps']:10.0f} {r['ratio']:6.2f} "
              f"{r.get('ember_MBps', 0):10.0f} {r.get('cat_MBps', 0):9.0f} "
              f"{100 * r.get('of_cat', 0):6.1f}")
    out = Path(__file__).parent / "results" / "shards.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"quick": args.quick, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
