"""RayShardLoader on a local Ray cluster (a head and two worker nodes, one CPU each) over shards
written by the webdataset package: exactly-once delivery for one and two consumers, errors
handled as locally, exact resumption, and fit / ``ember train`` fed from the cluster."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from ember.shards import (
    RayShardLoader,
    ShardDataset,
    ShardError,
    TruncatedShardError,
    warn_and_continue,
    warn_and_stop,
)

NSHARDS, PER_SHARD, LAST = 6, 8, 4  # the last shard holds LAST samples
NSAMPLES = (NSHARDS - 1) * PER_SHARD + LAST


ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ember[ray]')")
wds = pytest.importorskip("webdataset", reason="the shards are written by webdataset")


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, one CPU each, this process connected as the driver."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    env = dict(os.environ)  # Ray's driver sets a few variables (PYTHONBREAKPOINT, ...)
    # the test module's functions reach the workers by value (the workers cannot import it)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    store = 80 << 20
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": store,
                                                      "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=store)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    os.environ.clear()
    os.environ.update(env)


def _png(value: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """(pattern, URL list, keys): NSHARDS shards written by webdataset, PNG images and a class."""
    d = tmp_path_factory.mktemp("ray-shards")
    keys = [f"k{i:04d}" for i in range(NSAMPLES)]
    with wds.ShardWriter(str(d / "s-%06d.tar"), maxcount=PER_SHARD, verbose=0) as w:
        for i, key in enumerate(keys):
            w.write({"__key__": key, "png": _png(i * 5), "cls": str(i % 3)})
    urls = [str(d / f"s-{i:06d}.tar") for i in range(NSHARDS)]
    assert all(os.path.exists(u) for u in urls)
    return str(d / f"s-{{000000..{NSHARDS - 1:06d}}}.tar"), urls, keys


def _keys(loader) -> list[str]:
    """The sample keys in the order ``loader`` delivers them (items or batches of (key, ...))."""
    out = []
    for item in loader:
        key = item[0]
        out.extend(key if isinstance(key, list) else [key])
    return out


def test_one_consumer_gets_every_sample_once_in_a_reproducible_order(cluster, shards):
    pattern, _, keys = shards
    make = lambda: ShardDataset(pattern, seed=7).to_tuple("__key__ cls")
    loader = RayShardLoader(make())
    first = _keys(loader)
    second = _keys(loader)  # the next epoch
    assert sorted(first) == keys and sorted(second) == keys
    assert _keys(RayShardLoader(make())) == first  # same seed, same epoch: same order
    assert second != first
    # the shard order is the local plan's: shard by shard, as one local reading stream reads
    local = [k for k, _ in make()]
    assert first == local


def _slow_first_shard(item):
    import time

    if int(item[0][1:]) < PER_SHARD:
        time.sleep(0.05)
    return item


def test_order_is_the_plans_not_the_order_tasks_finish(cluster, shards):
    pattern, _, keys = shards
    # shard 0's task is the slowest, so later shards finish first; they still come after it
    ds = ShardDataset(pattern, shuffle_shards=False).to_tuple("__key__ cls").map(
        _slow_first_shard)
    assert _keys(RayShardLoader(ds, max_in_flight=3)) == keys


def test_two_consumers_split_every_sample_once_in_batches(cluster, shards):
    pattern, _, keys = shards
    ds = ShardDataset(pattern, seed=3).decode("torchrgb").to_tuple("__key__ png cls").batched(5)
    parts = RayShardLoader(ds).split(2)
    got = []
    for part in parts:
        batches = list(part)
        assert all(len(b[0]) == 5 for b in batches[:-1]) and 1 <= len(batches[-1][0]) <= 5
        for names, images, labels in batches:
            assert images.shape == (len(names), 3, 8, 8) and images.dtype == torch.float32
            # each image is the constant 5 * i / 255 of its sample i; each label is i % 3
            idx = torch.tensor([int(n[1:]) for n in names])
            torch.testing.assert_close(images[:, 0, 0, 0], (idx * 5).float() / 255)
            assert torch.equal(labels, idx % 3)
        got.append([n for b in batches for n in b[0]])
    assert not set(got[0]) & set(got[1])
    assert sorted(got[0] + got[1]) == keys


def test_two_consumers_with_equalize_drop_get_equal_streams(cluster, shards):
    pattern, _, keys = shards
    ds = ShardDataset(pattern, seed=1, equalize="drop").to_tuple("__key__ cls").batched(4)
    local = [[k for b in ShardDataset(pattern, seed=1, equalize="drop", rank=r, world_size=2)
              .to_tuple("__key__ cls").batched(4) for k in b[0]] for r in range(2)]
    got = [_keys(part) for part in RayShardLoader(ds).split(2)]
    assert len(got[0]) == len(got[1]) == len(local[0]) == len(local[1]) < NSAMPLES // 2 + 1
    assert len(set(got[0] + got[1])) == len(got[0]) * 2  # nothing twice
    assert set(got[0] + got[1]) <= set(keys)
    # the same samples as local reading with one worker per rank (batches cut differently)
    assert [sorted(g) for g in got] == [sorted(x) for x in local]

    ds = ShardDataset(pattern, seed=1, equalize="repeat").to_tuple("__key__ cls")
    got = [_keys(part) for part in RayShardLoader(ds).split(2)]
    assert len(got[0]) == len(got[1]) > NSAMPLES // 2
    assert set(got[0] + got[1]) == set(keys)  # everything, a few samples twice


@pytest.fixture(scope="module")
def with_truncated(shards, tmp_path_factory):
    """The URL list with shard 2 cut in the middle of its fifth sample's image."""
    _, urls, _ = shards
    d = tmp_path_factory.mktemp("ray-truncated")
    out = []
    for u in urls:
        dst = str(d / os.path.basename(u))
        shutil.copy(u, dst)
        out.append(dst)
    with open(out[2], "rb") as f:
        data = f.read()
    member = data.find(b"k0020.png")  # sample 4 of shard 2 (keys 16..23)
    with open(out[2], "wb") as f:
        f.write(data[:member + 512 + 40])  # its header and 40 bytes of its data
    return out


def test_truncated_shard_is_skipped_and_counted_as_locally(cluster, with_truncated):
    make = lambda: ShardDataset(with_truncated, seed=2, on_error="warn").to_tuple("__key__ cls")
    local = make()
    with pytest.warns(UserWarning, match="s-000002.tar"):
        expected = sorted(k for k, _ in local)
    loader = RayShardLoader(make())
    with pytest.warns(UserWarning, match=r"skipped: shard .*s-000002.tar at byte"):
        got = _keys(loader)
    assert sorted(got) == expected
    assert "k0019" in got and "k0020" not in got  # the samples before the cut, none after
    assert loader.error_count == local.error_count == 1

    seen = []
    loader = RayShardLoader(ShardDataset(with_truncated, seed=2, on_error=seen.append)
                            .to_tuple("__key__ cls"))
    assert sorted(_keys(loader)) == expected
    assert [type(e) for e in seen] == [TruncatedShardError]  # called here, in the trainer
    assert seen[0].url.endswith("s-000002.tar") and seen[0].offset is not None


def test_truncated_shard_raises_after_the_samples_before_it(cluster, with_truncated):
    loader = RayShardLoader(ShardDataset(with_truncated, shuffle_shards=False)
                            .to_tuple("__key__ cls"))
    got = []
    with pytest.raises(TruncatedShardError, match="s-000002.tar") as info:
        for key, _ in loader:
            got.append(key)
    assert got == [f"k{i:04d}" for i in range(20)]
    assert info.value.url.endswith("s-000002.tar")


def _fails_on_threes(item):
    key, label = item
    if key.endswith("3"):
        raise ValueError(f"no threes: {key}")
    return key, label


def test_map_that_raises_is_handled_as_locally(cluster, shards):
    pattern, _, keys = shards
    make = lambda: ShardDataset(pattern, seed=4).to_tuple("__key__ cls").map(
        _fails_on_threes, handler=warn_and_continue)
    local = make()
    expected = [k for k, _ in local]
    loader = RayShardLoader(make())
    assert _keys(loader) == expected == [k for k in expected if not k.endswith("3")]
    assert sorted(expected) == [k for k in keys if not k.endswith("3")]
    assert loader.error_count == local.error_count == 5

    # no handler: the exception reaches the trainer, as it is, after the items before it
    loader = RayShardLoader(ShardDataset(pattern, shuffle_shards=False)
                            .to_tuple("__key__ cls").map(_fails_on_threes))
    got = []
    with pytest.raises(ValueError, match="no threes: k0003"):
        for key, _ in loader:
            got.append(key)
    assert got == ["k0000", "k0001", "k0002"]

    # a handler that stops ends the rank's stream after that shard's items, as locally
    make = lambda: ShardDataset(pattern, shuffle_shards=False).to_tuple("__key__ cls").map(
        _fails_on_threes, handler=warn_and_stop)
    loader = RayShardLoader(make())
    assert _keys(loader) == [k for k, _ in make()] == ["k0000", "k0001", "k0002"]
    assert loader.error_count == 1


def test_resumes_mid_epoch_exactly(cluster, shards):
    pattern, _, _ = shards
    make = lambda: (ShardDataset(pattern, seed=5).shuffle(6).to_tuple("__key__ cls")
                    .batched(3))
    full = [b[0] for b in RayShardLoader(make())]
    for stop in (1, 4, len(full) - 1):
        loader = RayShardLoader(make())
        head = []
        for b in loader:
            head.append(b[0])
            if len(head) == stop:
                break
        state = loader.state_dict()
        resumed = RayShardLoader(make())
        resumed.load_state_dict(state)
        assert head + [b[0] for b in resumed] == full, stop
        assert resumed.epoch == 1


def test_fit_and_ember_train_from_the_cluster(cluster, shards, tmp_path):
    from ember.cli import main
    from ember.train import TrainConfig, fit

    pattern, _, _ = shards
    loader = RayShardLoader(ShardDataset(pattern, seed=0).decode("torchrgb")
                            .to_tuple("png cls").batched(8))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = fit(model, opt, loader, TrainConfig(epochs=2, progress=False))
    assert result.steps == 2 * -(-NSAMPLES // 8)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert loader.epoch == 2

    out = tmp_path / "run"
    code = main(["train", "--data", pattern, "--num-classes", "3", "--epochs", "1",
                 "--batch-size", "8", "--ray-address", cluster.address, "--out", str(out),
                 "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == -(-NSAMPLES // 8)


def _noisy(item):
    """An augmentation drawing from torch's global generator (seeded per task on the workers)."""
    image, label = item
    return image + 0.1 * torch.rand_like(image), label


class _Killed(RuntimeError):
    pass


def test_fit_killed_mid_epoch_and_resumed_is_bit_identical(cluster, shards, tmp_path):
    from ember.train import TrainConfig, fit, weights_digest

    pattern, _, _ = shards

    def run(out, kill_at=None, **kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # batches of 3 from shards of 8: every shard leaves 2 samples to batch in the trainer
        loader = RayShardLoader(ShardDataset(pattern, seed=9).shuffle(4).decode("torchrgb")
                                .to_tuple("png cls").map(_noisy).batched(3))

        def on_step(step, record):
            if step == kill_at:
                raise _Killed(step)

        config = TrainConfig(epochs=2, checkpoint_dir=out, checkpoint_every=3, progress=False,
                             **kw)
        result = fit(model, opt, loader, config, on_step=on_step)
        return weights_digest(result.model), result.steps

    reference = run(tmp_path / "ref")
    assert reference[1] == 2 * 15
    with pytest.raises(_Killed):
        run(tmp_path / "cut", kill_at=7)  # checkpointed at step 6, inside epoch 0
    state = torch.load(tmp_path / "cut" / "last.pt", weights_only=False)
    assert state["ranks"][0]["data"]["task"] > 0  # a mid-epoch position
    assert run(tmp_path / "cut", resume="auto") == reference


def test_closing_iterators_early_again_and_again_cancels_nothing(cluster, shards, monkeypatch):
    # ray.cancel of running streaming generator tasks once aborted the trainer inside Ray
    # ("Tried to complete task that was not pending"): an iterator closed early drops its
    # tasks' generators instead, and the loader goes on
    pattern, _, keys = shards
    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda *a, **kw: cancelled.append(a))
    ds = ShardDataset(pattern, seed=11).shuffle(4).to_tuple("__key__ cls").batched(
        3, collation_fn=None)
    loader = RayShardLoader(ds)
    first = [k for b in RayShardLoader(ds) for k, _ in b]
    for cycle in range(30):
        it = iter(loader)
        got = [next(it) for _ in range(cycle % 5)]
        it.close()
        assert [k for b in got for k, _ in b] == first[:3 * (cycle % 5)]
    assert cancelled == []
    assert [k for b in loader for k, _ in b] == first  # the epoch, whole, from its start
    assert sorted(first) == keys


def test_equalize_repeat_reads_a_truncated_shard_again_as_locally(cluster, with_truncated):
    # rank 0 reads the truncated shard (4 of its declared 8 samples) and the 4-sample shard,
    # then both again for its quota of 16: locally the second read of the truncated shard
    # runs into the cut again (the rank is short), so it is reported twice
    urls = [with_truncated[2], with_truncated[0], with_truncated[5], with_truncated[1]]

    def make(seen):
        return ShardDataset(urls, shuffle_shards=False, equalize="repeat", on_error=seen.append,
                            shard_sizes=[PER_SHARD, PER_SHARD, LAST, PER_SHARD], rank=0,
                            world_size=2).to_tuple("__key__ cls")

    seen_local, seen_ray = [], []
    local = make(seen_local)
    expected = [k for k, _ in local]
    loader = RayShardLoader(make(seen_ray))
    assert _keys(loader) == expected and len(expected) == 2 * PER_SHARD
    assert loader.error_count == local.error_count == 2
    assert [type(e) for e in seen_ray] == [type(e) for e in seen_local] == \
        [TruncatedShardError] * 2


def _recorded(fn) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return sorted(str(w.message) for w in seen if "no threes" in str(w.message))


def test_stage_handler_warnings_reach_the_trainer(cluster, shards):
    pattern, _, _ = shards
    for handler, count in ((warn_and_continue, 5), (warn_and_stop, 1)):
        make = lambda h=handler: ShardDataset(pattern, shuffle_shards=False).to_tuple(
            "__key__ cls").map(_fails_on_threes, handler=h)
        local = _recorded(lambda m=make: list(m()))
        got = _recorded(lambda m=make: list(RayShardLoader(m())))
        assert got == local and len(local) == count


def test_address_of_another_cluster_warns_when_ray_is_initialised(cluster, shards):
    import warnings

    pattern, _, _ = shards
    with pytest.warns(RuntimeWarning, match=r"address='127.0.0.1:1'.* is not used: Ray is "
                                            r"already initialised"):
        RayShardLoader(ShardDataset(pattern), address="127.0.0.1:1").connect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RayShardLoader(ShardDataset(pattern), address=cluster.address).connect()
        RayShardLoader(ShardDataset(pattern), address="auto").connect()


def test_a_stage_that_cannot_be_pickled_is_named(cluster, shards):
    import threading

    pattern, _, _ = shards
    lock = threading.Lock()

    def uses_lock(item):
        with lock:
            return item

    loader = RayShardLoader(ShardDataset(pattern).to_tuple("__key__ cls").map(uses_lock))
    with pytest.raises(TypeError, match=r"stage 1 \(map .*uses_lock\) cannot be pickled "
                                        r"\(TypeError: cannot pickle '_thread.lock' object\)") as info:
        next(iter(loader))
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_newer_iterator_takes_over_and_the_older_one_raises(cluster, shards):
    pattern, _, _ = shards
    loader = RayShardLoader(ShardDataset(pattern, seed=3).to_tuple("__key__ cls"))
    first = _keys(RayShardLoader(ShardDataset(pattern, seed=3).to_tuple("__key__ cls")))
    old = iter(loader)
    assert [next(old)[0] for _ in range(3)] == first[:3]
    new = iter(loader)
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(old)
    assert [k for k, _ in new] == first  # the epoch from its start, then it ends
    assert loader.epoch == 1


def _dies_on_k0010(item):
    if item[0] == "k0010":
        os._exit(1)  # the Ray worker process dies, as in a crash in native decoding code
    return item


def test_a_worker_that_dies_is_a_shard_error_through_on_error(cluster, shards):
    pattern, urls, keys = shards
    crashed = urls[1]  # k0010 is its third sample
    others = [k for k in keys if not PER_SHARD <= int(k[1:]) < 2 * PER_SHARD]
    args = {"num_cpus": 1, "max_retries": 0}  # Ray's own retries would only take longer here

    def make(on_error):
        ds = ShardDataset(pattern, shuffle_shards=False, on_error=on_error)
        return RayShardLoader(ds.to_tuple("__key__ cls").map(_dies_on_k0010),
                              ray_remote_args=args, transfer_group=1)

    with pytest.raises(ShardError, match=f"shard {crashed}: .*Ray worker.*died"):
        _keys(make("raise"))
    loader = make("skip")
    got = _keys(loader)
    assert len(got) == len(set(got)) and set(others) <= set(got)
    assert set(got) - set(others) <= {"k0008", "k0009"}  # handed out before the crash
    assert loader.error_count == 1


def _open_after_colon(url, options):
    return open(url.split(":", 1)[1], "rb")


def test_a_scheme_registered_in_the_driver_reaches_the_workers(cluster, shards, monkeypatch):
    from ember.shards import register_opener
    from ember.shards import urls as urls_module

    # registered in this process only: Ray's worker processes know the built-in schemes alone
    monkeypatch.setattr(urls_module, "_SCHEMES", dict(urls_module._SCHEMES))
    register_opener("ray-test", _open_after_colon)
    _, urls, keys = shards
    ds = ShardDataset([f"ray-test:{u}" for u in urls], seed=7).to_tuple("__key__ cls")
    assert sorted(_keys(RayShardLoader(ds))) == keys


def test_a_user_final_scope_stage_is_batched_across_shards_as_batched_is(cluster, shards):
    from ember.shards import stages as stage_module

    class _Groups(stage_module.Stage):
        name = "groups_for_test"
        ray_scope = "final"

        def __init__(self, size: int):
            self.batchsize, self.collation_fn, self.partial = size, None, True

        def apply(self, src, ctx, index):
            return stage_module.batched(src, self.batchsize, ctx.collate(None), True)

    pattern, _, keys = shards
    try:
        ds = ShardDataset(pattern, seed=3).to_tuple("__key__ cls").groups_for_test(5)
        batches = list(RayShardLoader(ds))
        # a shard holds 8 samples: a per-shard stage would give batches of 5 and 3
        assert [len(b) for b in batches[:-1]] == [5] * (len(batches) - 1)
        assert sorted(k for b in batches for k, _ in b) == keys
    finally:
        stage_module.REGISTRY.pop("groups_for_test", None)
        delattr(ShardDataset, "groups_for_test")
