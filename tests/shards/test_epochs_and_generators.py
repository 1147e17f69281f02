"""Epoch numbers that count full passes (loader-level stages draining after the workers), and
shuffles drawn from a generator's own stream (ember.csprng generators, OS-keyed or seeded)."""

from __future__ import annotations

import pytest
import webdataset as wds

from ember.shards import ShardDataset, ShardLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

EPOCHS = 3


def _shards(tmp_path, nshards=4, per_shard=6):
    urls = []
    for i in range(nshards):
        url = str(tmp_path / f"e-{i:03d}.tar")
        with wds.TarWriter(url) as w:
            for j in range(per_shard):
                w.write({"__key__": f"e{i:03d}_{j:03d}", "cls": i * per_shard + j})
        urls.append(url)
    return urls


def _pair(sample):
    return sample["__key__"], int(sample["cls"])


def _rebatching(urls, num_workers):
    # the loader's shuffle buffer holds a whole epoch: every batch comes out after the workers end
    ds = ShardDataset(urls, seed=4).map(_pair).batched(3)
    return ShardLoader(ds, num_workers=num_workers).unbatched().shuffle(64).batched(4)


def _keys(batch):
    return tuple(batch[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_stays_while_loader_stages_drain(tmp_path, num_workers):
    loader = _rebatching(_shards(tmp_path), num_workers)
    seen = []
    for _batch in loader:
        seen.append((loader.epoch, loader.state_dict()["epoch"]))
    assert len(seen) == 6 and seen == [(0, 0)] * 6
    assert loader.epoch == 1 and loader.state_dict()["epoch"] == 1
    for _batch in loader:
        assert loader.epoch == 1 and loader.state_dict()["epoch"] == 1
    assert loader.epoch == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_loop_over_epochs_skips_no_epoch(tmp_path, num_workers):
    urls = _shards(tmp_path)
    ref = _rebatching(urls, num_workers)
    full = [_keys(b) for _ in range(EPOCHS) for b in ref]
    assert len(full) == 6 * EPOCHS
    for stop in (1, 3, 5, 6):
        loader = _rebatching(urls, num_workers)
        head = []
        for batch in loader:
            head.append(_keys(batch))
            if len(head) == stop:
                break
        state = loader.state_dict()
        resumed = _rebatching(urls, num_workers)
        resumed.load_state_dict(state)
        rest = [_keys(b) for _ in range(state["epoch"], EPOCHS) for b in resumed]
        assert head + rest == full, stop
        # a state saved while draining by an older ember named the next epoch
        older = {k: v for k, v in state.items() if k != "loader_epoch"}
        older["epoch"] += 1
        resumed = _rebatching(urls, num_workers)
        resumed.load_state_dict(older)
        assert resumed.epoch == state["epoch"]
        assert [_keys(b) for b in resumed] == full[stop:6], stop


# ---- generator= ----------------------------------------------------------------------------------

def _order(urls, generator, **kw):
    ds = ShardDataset(urls, generator=generator, **kw).shuffle(16).map(_pair)
    return [k for k, _ in ds]


def test_os_keyed_generator_iterates_and_leaves_the_generator_as_it_was(tmp_path):
    from ember.csprng import create_random_device_generator

    urls = _shards(tmp_path)
    g = create_random_device_generator()
    before = bytes(g.get_state().tolist())
    got = _order(urls, g)
    assert sorted(got) == sorted(f"e{i:03d}_{j:03d}" for i in range(4) for j in range(6))
    assert bytes(g.get_state().tolist()) == before  # drawn through substreams, not from g


def test_two_os_keyed_generators_give_different_orders(tmp_path):
    from ember.csprng import create_random_device_generator

    urls = _shards(tmp_path)
    orders = []
    for _ in range(2):
        g = create_random_device_generator(allow_pickle=True)
        orders.append(_order(urls, g, seed=5))
    assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]


def test_the_same_seeded_generator_repeats_and_seed_keys_differ(tmp_path):
    from ember.csprng import create_generator

    urls = _shards(tmp_path)
    g = create_generator(7)
    first = _order(urls, g)
    assert _order(urls, g) == first  # the generator is not consumed
    assert _order(urls, create_generator(7)) == first
    other = _order(urls, create_generator(8))
    assert sorted(other) == sorted(first) and other != first
    # the draws come from the generator's key, not from seed=
    assert _order(urls, create_generator(7), seed=123) == first


@pytest.mark.parametrize("num_workers", [0, 2])
def test_os_keyed_generator_with_loader_workers_delivers_every_sample_once(tmp_path,
                                                                          num_workers):
    from ember.csprng import create_random_device_generator

    urls = _shards(tmp_path, nshards=6)
    g = create_random_device_generator()
    ds = ShardDataset(urls, generator=g).shuffle(8).map(_pair)
    loader = ShardLoader(ds, num_workers=num_workers)
    for _ in range(2):
        keys = [k for k, _ in loader]
        assert sorted(keys) == sorted(f"e{i:03d}_{j:03d}" for i in range(6) for j in range(6))


def test_pickled_dataset_holds_no_key_of_the_generator_given(tmp_path):
    import pickle

    from ember.csprng import create_random_device_generator

    urls = _shards(tmp_path)
    g = create_random_device_generator()
    ds = ShardDataset(urls, generator=g).shuffle(8)
    data = pickle.dumps(ds)  # what a spawned DataLoader worker receives
    key = bytes(g.get_state().tolist())[8:24]
    assert key not in data
    copy = pickle.loads(data)
    assert [s["__key__"] for s in copy] == [s["__key__"] for s in ds]


def test_os_keyed_generator_over_several_ranks_is_refused_naming_the_fix(tmp_path):
    from ember.csprng import create_generator, create_random_device_generator

    urls = _shards(tmp_path)
    ds = ShardDataset(urls, generator=create_random_device_generator(), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"keyed from the OS.*create_generator\(seed\)"):
        next(iter(ds))
    # one key on every rank: the ranks together read every shard once
    parts = [[s["__key__"] for s in ShardDataset(urls, generator=create_generator(3), rank=r,
                                                  world_size=2)] for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(f"e{i:03d}_{j:03d}" for i in range(4)
                                                 for j in range(6))
    own = ShardDataset(urls[:2], generator=create_random_device_generator(), nodesplitter=None,
                       rank=0, world_size=2)
    assert len(list(own)) == 12


def test_loader_level_shuffle_draws_from_the_generator_not_seed(tmp_path):
    from ember.csprng import create_generator

    urls = _shards(tmp_path)

    def order(generator, seed):
        ds = ShardDataset(urls, seed=seed, shuffle_shards=False, generator=generator)
        loader = ShardLoader(ds.map(_pair).batched(3)).unbatched().shuffle(64).batched(4)
        return [k for b in loader for k in b[0]]

    first = order(create_generator(7), 1)
    assert order(create_generator(7), 2) == first
    other = order(create_generator(8), 1)
    assert sorted(other) == sorted(first) and other != first
