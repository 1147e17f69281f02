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

``--ray`` runs only the Ray section instead: a decode-heavy pipeline (PNG decode + resize to
112x112, batches of 32) over the same shards through ShardLoader with 2 DataLoader workers, and
through RayShardLoader on a local Ray cluster of two worker nodes with one CPU each (the same two
CPUs of work), interleaved, ``--repeat`` epochs each (at least 5; median and spread), plus the
same pipeline in the main process alone (the work per sample). It reports samples/s, the Ray
path's cost per sample (CPU-seconds of its slots beyond the pipeline's own work, and the
training process's CPU time) and writes bench/results/shards_ray.json.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ember.shards import ShardDataset, ShardLoader, ShardWriter, UrlOptions, tar

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
    options = UrlOptions(cache_dir=str(cache))
    _read(ShardDataset(urls, shuffle_shards=False, url_options=options), 0, n)  # epoch 1 fills it
    local, cached, resampled = [], [], []
    for _ in range(repeat):
        local.append(_read(ShardDataset(files, shuffle_shards=False), 0, n))
        cached.append(_read(ShardDataset(urls, shuffle_shards=False, url_options=options), 0, n))
        resampled.append(_read(ShardDataset(files, resampled=True).with_epoch(n), 0, n))
    tl = min(local)
    return [{"case": f"cache_dir 2nd epoch {label}", "feature_sps": n / min(cached),
             "local_sps": n / tl, "ratio": tl / min(cached), "goal": 0.9},
            {"case": f"resampled {label}", "feature_sps": n / min(resampled),
             "local_sps": n / tl, "ratio": tl / min(resampled), "goal": 1.0}]


# ---- --ray: a decode-heavy pipeline on local workers and on a local Ray cluster ---------------

RAY_IMAGE = 256  # side of the PNG images written
RAY_RESIZE = 112  # side they are resized to
RAY_BATCH = 32
RAY_NODE_CPUS = 16  # CPUs of a cluster node in the projection to more nodes


def _image_shards(d: str, nshards: int, per_shard: int) -> list[str]:
    """PNG images (a smooth gradient with noise, so they compress as photos do) and a class."""
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, RAY_IMAGE, dtype=np.float32)
    with ShardWriter(f"{d}/img-%03d.tar", maxcount=per_shard) as w:
        for i in range(nshards * per_shard):
            base = ramp[None, :, None] + ramp[:, None, None] * ((i % 7) / 7)
            pixels = base + rng.normal(0, 12, (RAY_IMAGE, RAY_IMAGE, 3))
            buf = io.BytesIO()
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="PNG")
            w.write({"__key__": f"i{i:07d}", "png": buf.getvalue(), "cls": i % 10})
    return sorted(str(p) for p in Path(d).glob("img-*.tar"))


def _resize(item: tuple) -> tuple:
    """PIL image -> (3, RAY_RESIZE, RAY_RESIZE) uint8 tensor, bilinear (the augmentation step)."""
    import torch
    from PIL import Image

    image, label = item
    small = image.resize((RAY_RESIZE, RAY_RESIZE), Image.BILINEAR)
    return torch.from_numpy(np.asarray(small)).permute(2, 0, 1).contiguous(), label


def _decode_pipeline(files: list[str]) -> ShardDataset:
    return (ShardDataset(files, seed=0).decode("pil").to_tuple("png cls").map(_resize)
            .batched(RAY_BATCH))


def _epoch(loader, n: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for one epoch of ``loader``, checking the count."""
    t, c = time.perf_counter(), time.process_time()
    got = sum(len(labels) for _, labels in loader)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    if got != n:
        raise RuntimeError(f"read {got} samples, expected {n}")
    return wall, cpu


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ray_main(args: argparse.Namespace) -> int:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from ember.shards import RayShardLoader

    warnings.filterwarnings("ignore")
    # one thread here, as in DataLoader workers and Ray tasks (Ray sets OMP_NUM_THREADS to the
    # task's CPUs): the leftover batches collated here, and the one-process baseline, must not
    # spin OpenMP threads against the readers on a small machine
    torch.set_num_threads(1)
    nshards, per_shard = (8, 32) if args.quick else (16, 128)
    n = nshards * per_shard
    repeat = max(args.repeat, 2 if args.quick else 5)
    slots = 2
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        files = _image_shards(d, nshards, per_shard)
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        # the work per sample: the pipeline in this process alone
        work = [_epoch(_decode_pipeline(files), n)[0] / n for _ in range(2)]
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "object_store_memory": 200 << 20})
        for _ in range(slots):
            cluster.add_node(num_cpus=1, object_store_memory=200 << 20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            local = ShardLoader(_decode_pipeline(files), num_workers=slots)
            remote = RayShardLoader(_decode_pipeline(files))
            _epoch(remote, n)  # untimed: starts the Ray workers (and their imports)
            times: dict[str, list[tuple[float, float]]] = {"local": [], "ray": []}
            for _ in range(repeat):  # interleaved, so load from other jobs hits both alike
                times["local"].append(_epoch(local, n))
                times["ray"].append(_epoch(remote, n))
        finally:
            ray.shutdown()
            cluster.shutdown()
    per = min(work)
    rows = {}
    for name, runs in times.items():
        sps = [n / wall for wall, _ in runs]
        rows[name] = {"samples_per_s": _spread(sps),
                      "trainer_cpu_us_per_sample": _spread([cpu / n * 1e6 for _, cpu in runs]),
                      # CPU-seconds of the reading slots per sample beyond the pipeline's own work
                      "overhead_us_per_sample": _spread([(slots * wall / n - per) * 1e6
                                                         for wall, _ in runs])}
    ratio = [r / lo for (r, _), (lo, _) in zip(times["ray"], times["local"], strict=True)]
    result = {"samples": n, "shards": nshards, "MB": mb, "slots": slots, "repeat": repeat,
              "quick": args.quick, "cpus": os.cpu_count(), "python": platform.python_version(),
              "ray": ray.__version__, "load_before": load_before, "load_after": os.getloadavg(),
              "work_us_per_sample": per * 1e6, "work_samples_per_s_one_core": 1 / per,
              "rows": rows, "ray_time_over_local": _spread(ratio)}
    print(f"PNG {RAY_IMAGE}px -> {RAY_RESIZE}px, batches of {RAY_BATCH}: {n} samples in "
          f"{nshards} shards ({mb:.0f} MB); {repeat} interleaved epochs each; load "
          f"{load_before[0]:.2f} before, {result['load_after'][0]:.2f} after")
    print(f"pipeline alone in one process: {per * 1e6:.0f} us/sample ({1 / per:.0f} samples/s)")
    print(f"{'reader (2 CPUs)':24} {'samples/s med':>13} {'[min, max]':>17} "
          f"{'overhead us/s':>13} {'trainer CPU us/s':>16}")
    for name, label in (("local", "ShardLoader 2 workers"), ("ray", "Ray, 2 nodes x 1 CPU")):
        r = rows[name]
        sps, over, cpu = r["samples_per_s"], r["overhead_us_per_sample"], \
            r["trainer_cpu_us_per_sample"]
        print(f"{label:24} {sps['median']:13.0f} [{sps['min']:7.0f}, {sps['max']:7.0f}] "
              f"{over['median']:13.0f} {cpu['median']:16.0f}")
    print(f"Ray time / local time: median {result['ray_time_over_local']['median']:.2f} "
          f"[{result['ray_time_over_local']['min']:.2f}, {result['ray_time_over_local']['max']:.2f}]")
    # scaling: each node adds its CPUs x the rate of one task slot; the training process pays
    # its own CPU time per sample whatever the cluster's size, which caps what one trainer takes
    slot = rows["ray"]["samples_per_s"]["median"] / slots
    cap = 1e6 / rows["ray"]["trainer_cpu_us_per_sample"]["median"]
    result["projection"] = {"per_slot_samples_per_s": slot, "trainer_cap_samples_per_s": cap,
                            "cpus_per_node": RAY_NODE_CPUS,
                            "nodes": {k: min(k * RAY_NODE_CPUS * slot, cap) for k in (1, 2, 4, 8)}}
    print(f"projection: {slot:.0f} samples/s per task slot, one trainer takes at most {cap:.0f} "
          f"samples/s; nodes of {RAY_NODE_CPUS} CPUs: " + ", ".join(
              f"{k}: {v:.0f}" for k, v in result["projection"]["nodes"].items()))
    out = args.out if args.out_given else args.out.with_name("shards_ray.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the samples")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is kept)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ray", action="store_true",
                    help="only the decode-heavy pipeline: local workers against a local Ray cluster")
    args = ap.parse_args()
    args.out_given = args.out is not None
    if args.out is None:
        args.out = Path(__file__).parent / "results" / "shards.json"
    if args.ray:
        return ray_main(args)
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
