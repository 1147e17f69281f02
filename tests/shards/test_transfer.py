"""Shared-memory transfer of sample groups from ShardLoader workers (ember.shards.transfer)."""

from __future__ import annotations

import multiprocessing

import pytest

from ember.shards import ShardDataset, ShardLoader
from ember.shards.transfer import MIN_SHARED_BYTES, PackedGroup, TransferArena

fork_only = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                               reason="the arena needs fork")

BIG = MIN_SHARED_BYTES


def _big(i: int, n: int = BIG) -> bytes:
    return bytes([i % 251]) * n


def _send(arena: TransferArena, stream: int, items: list):
    """What a worker sends for ``items``: each packed as it is collected, then sealed."""
    return arena.seal(stream, [arena.pack(stream, item) for item in items])


@fork_only
def test_round_trip_keeps_every_value_and_type():
    arena = TransferArena(2, 2, 64 << 10)
    items = [
        {"__key__": "a", "bin": _big(1), "cls": b"3", "n": 7},
        (_big(2), b"small", "text"),
        [_big(3, BIG + 1), _big(4)],
        "not a container",
        {"x": bytearray(_big(5))},  # only bytes move: a bytearray stays in the pickle
    ]
    expected = [dict(items[0]), tuple(items[1]), list(items[2]), items[3], dict(items[4])]
    sent = _send(arena, 1, items)
    assert isinstance(sent, PackedGroup)
    # the large bytes values left the items; small ones and other types stayed
    assert sent.items[0]["bin"] is None and sent.items[0]["cls"] == b"3"
    assert sent.items[1] == (None, b"small", "text") and sent.items[2] == [None, None]
    assert sent.items[4]["x"] == bytearray(_big(5))
    assert items == expected  # the worker's own items were not changed
    got = list(arena.unpack(1, sent))
    assert got == expected
    assert [type(x) for x in got] == [dict, tuple, list, str, dict]


@fork_only
def test_values_that_do_not_fit_stay_in_the_pickle():
    arena = TransferArena(1, 1, 2 * BIG)
    items = [{"a": _big(1), "b": _big(2)}, {"a": _big(3)}, {"a": _big(4, 3 * BIG)}]
    sent = _send(arena, 0, items)
    assert sent.items[0] == {"a": None, "b": None}  # the slot is full after these two
    assert sent.items[1] == {"a": _big(3)} and sent.items[2] == {"a": _big(4, 3 * BIG)}
    assert list(arena.unpack(0, sent)) == items


@fork_only
def test_without_a_free_slot_groups_go_whole_and_slots_are_reused_in_order():
    arena = TransferArena(1, 2, 1 << 20)
    groups = [[{"v": _big(g * 10 + i)} for i in range(3)] for g in range(4)]
    first, second = _send(arena, 0, groups[0]), _send(arena, 0, groups[1])
    assert isinstance(first, PackedGroup) and isinstance(second, PackedGroup)
    assert (first.slot, second.slot) == (0, 1)
    third = _send(arena, 0, groups[2])  # both slots still in flight: nothing waits
    assert third == groups[2]
    assert list(arena.unpack(0, first)) == groups[0]  # frees slot 0 after its last item
    assert list(arena.unpack(0, third)) == groups[2]
    fourth = _send(arena, 0, groups[3])
    assert isinstance(fourth, PackedGroup) and fourth.slot == 0
    # slot 0 was overwritten by the fourth group; the second group's slot was not
    assert list(arena.unpack(0, second)) == groups[1]
    assert list(arena.unpack(0, fourth)) == groups[3]


@fork_only
def test_slot_stays_taken_until_the_last_item_is_handed_out():
    arena = TransferArena(1, 1, 1 << 20)
    g0 = [{"v": _big(i)} for i in range(3)]
    items = arena.unpack(0, _send(arena, 0, g0))
    assert next(items) == g0[0]
    g1 = [{"v": _big(7)}]
    assert _send(arena, 0, g1) == g1  # the slot still holds g0's other values
    assert list(items) == g0[1:]
    assert isinstance(_send(arena, 0, g1), PackedGroup)


@fork_only
def test_group_without_large_values_gives_its_slot_back():
    arena = TransferArena(1, 1, 1 << 20)
    small = [{"cls": b"1"}, {"cls": b"2"}]
    assert _send(arena, 0, small) == small
    assert isinstance(_send(arena, 0, [{"v": _big(1)}]), PackedGroup)


def test_arena_is_used_only_with_forked_workers(make_shards):
    pattern, _ = make_shards(2, 4)
    ds = ShardDataset(pattern)
    assert not TransferArena.supported("spawn") and not TransferArena.supported("forkserver")
    assert ShardLoader(ds, num_workers=2, multiprocessing_context="spawn")._arena() is None
    assert ShardLoader(ds, num_workers=0)._arena() is None
    assert ShardLoader(ds, num_workers=2, transfer_memory=0)._arena() is None
    assert ShardLoader(ds.batched(2), num_workers=2)._arena() is None  # batches go one by one
    if "fork" in multiprocessing.get_all_start_methods():
        arena = ShardLoader(ds, num_workers=2, multiprocessing_context="fork")._arena()
        assert isinstance(arena, TransferArena)
        arena.close()
    with pytest.raises(ValueError, match="transfer_memory"):
        ShardLoader(ds, num_workers=2, transfer_memory=-1)


def _contents(loader) -> dict:
    return {s["__key__"]: (s["bin"], s["cls"]) for s in loader}


@fork_only
@pytest.mark.parametrize("memory", [1 << 20, 3 * (BIG + 100), 0])
def test_loader_delivers_the_same_samples_through_shared_memory(make_shards, monkeypatch, memory):
    # payloads above the threshold, so they take the arena (or the pipe where a slot is full)
    pattern, keys = make_shards(4, 9, payload=BIG + 100)
    expected = _contents(ShardDataset(pattern))
    assert len(expected) == len(keys) and len(expected[keys[5]][0]) == BIG + 100
    packed = []
    unpack = TransferArena.unpack

    def counting(self, stream, group):
        packed.append(isinstance(group, PackedGroup))
        return unpack(self, stream, group)

    monkeypatch.setattr(TransferArena, "unpack", counting)
    loader = ShardLoader(ShardDataset(pattern), num_workers=2, transfer_group=4,
                         transfer_memory=memory, multiprocessing_context="fork")
    assert _contents(loader) == expected
    assert (memory > 0) == any(packed)


@fork_only
@pytest.mark.parametrize("stop", [1, 6, 17, 30])
def test_resume_through_shared_memory_is_exact(make_shards, stop_and_resume, stop):
    pattern, _ = make_shards(5, 7, payload=BIG)

    def make():
        return ShardDataset(pattern, seed=3).shuffle(5)

    full = [s["__key__"] for s in ShardLoader(make(), num_workers=2, transfer_group=4)]
    head, tail, _, _ = stop_and_resume(make, 2, stop, transfer_group=4)
    assert head + tail == full
