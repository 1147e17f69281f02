"""ember.csprng.Generator: constructors, torch.Generator API, substreams, persistence, safety."""

import copy
import os
import pickle
import sys

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import CounterExhausted, InheritedStateUsed


def draw(g, n=64):
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)


def test_is_not_a_torch_generator_so_torch_refuses_it_on_unrouted_paths():
    g = csprng.create_random_device_generator()
    assert not isinstance(g, torch.Generator) and csprng.is_generator(g)
    assert not csprng.is_generator(torch.Generator())
    assert g.device == torch.device("cpu")
    assert g.kind == "random_device" and not g.reproducible


def test_random_device_generators_differ():
    assert not torch.equal(draw(csprng.create_random_device_generator()),
                           draw(csprng.create_random_device_generator()))


def test_token_is_accepted_for_compatibility():
    g = csprng.create_random_device_generator("/dev/urandom")
    assert g.kind == "random_device"
    with pytest.raises(TypeError, match="token"):
        csprng.create_random_device_generator(123)


def test_seeded_generators_reproduce_and_differ_by_seed():
    a, b, c = (csprng.create_generator(s) for s in (1, 1, 2))
    ra, rb, rc = draw(a), draw(b), draw(c)
    assert torch.equal(ra, rb)
    assert not torch.equal(ra, rc)


def test_no_seed_takes_a_fresh_seed_that_reproduces_the_run():
    g = csprng.create_generator()
    seed = g.initial_seed()
    assert 0 <= seed < 2**128
    assert torch.equal(draw(g), draw(csprng.create_generator(seed)))


def test_key_argument_accepts_bytes_and_tensors():
    key = bytes(range(16))
    a = csprng.create_generator(key=key)
    b = csprng.create_generator(key=torch.arange(16, dtype=torch.uint8))
    assert a.kind == "keyed"
    assert torch.equal(draw(a), draw(b))
    with pytest.raises(ValueError, match="expected a 16-byte key, got 12 bytes"):
        csprng.create_generator(key=bytes(12))
    with pytest.raises(ValueError, match="not both"):
        csprng.create_generator(1, key=key)


def test_manual_seed_rekeys_like_create_generator():
    g = csprng.create_random_device_generator()
    assert g.manual_seed(99) is g
    assert g.kind == "seeded" and g.reproducible and g.initial_seed() == 99
    assert torch.equal(draw(g), draw(csprng.create_generator(99)))


def test_seed_returns_a_seed_that_manual_seed_reproduces():
    g = csprng.create_generator(0)
    s = g.seed()
    first = draw(g)
    assert torch.equal(first, draw(csprng.create_generator(0).manual_seed(s)))


def test_initial_seed_of_a_directly_keyed_generator_raises():
    with pytest.raises(RuntimeError, match="no initial seed"):
        csprng.create_random_device_generator().initial_seed()


@pytest.mark.parametrize("make", [
    lambda: csprng.create_random_device_generator(),
    lambda: csprng.create_generator(5),
    lambda: csprng.create_generator(key=bytes(16)),
    lambda: csprng.create_generator(5).fold_in(3),
])
def test_get_state_set_state_round_trip_exactly(make):
    g = make()
    draw(g, 10)
    state = g.get_state()
    assert state.dtype == torch.uint8
    after = draw(g, 100), torch.randn(7, generator=g)
    g2 = csprng.Generator().set_state(state)
    assert g2.kind == g.kind and g2.counter < g.counter
    again = draw(g2, 100), torch.randn(7, generator=g2)
    assert torch.equal(after[0], again[0]) and torch.equal(after[1], again[1])


def test_set_state_rejects_foreign_bytes():
    g = csprng.create_generator(1)
    with pytest.raises(ValueError, match="not an ember.csprng state"):
        g.set_state(torch.Generator().get_state())
    with pytest.raises(TypeError, match="uint8"):
        g.set_state(torch.zeros(64))


def test_fold_in_is_pure_and_leaves_the_parent_unchanged():
    g = csprng.create_generator(3)
    before = g.get_state()
    a, b, c = g.fold_in(1), g.fold_in(1), g.fold_in(2)
    assert torch.equal(g.get_state(), before)
    assert torch.equal(draw(a), draw(b))
    assert not torch.equal(draw(csprng.create_generator(3).fold_in(1)), draw(c))
    assert not torch.equal(draw(g.fold_in(1)), draw(csprng.create_generator(3)))


def test_spawn_gives_distinct_children_and_new_ones_each_call():
    g = csprng.create_generator(4)
    first, second = g.spawn(3), g.spawn(2)
    outs = [draw(x) for x in first + second]
    assert len({tuple(o.tolist()) for o in outs}) == 5
    again = csprng.create_generator(4).spawn(5)  # reproducible from the seed
    assert all(torch.equal(o, draw(x)) for o, x in zip(outs, again, strict=True))


def test_pickling_a_random_device_generator_is_refused_unless_allowed():
    g = csprng.create_random_device_generator()
    with pytest.raises(pickle.PicklingError, match="allow_pickle"):
        pickle.dumps(g)
    with pytest.raises(pickle.PicklingError):
        copy.deepcopy(g)
    g.allow_pickle = True
    g2 = pickle.loads(pickle.dumps(g))
    assert torch.equal(draw(g), draw(g2))


def test_seeded_generator_pickles_and_continues_its_stream():
    g = csprng.create_generator(8)
    draw(g)
    g2 = pickle.loads(pickle.dumps(g))
    assert torch.equal(draw(g), draw(g2))


def test_repr_and_errors_never_show_the_key():
    key = bytes(range(100, 116))
    g = csprng.create_generator(key=key)
    text = repr(g) + str(g)
    for form in (key.hex(), str(list(key)), repr(key)):
        assert form not in text
    g.set_state(_state_with_counter(g, 2**128))
    with pytest.raises(CounterExhausted) as info:
        torch.rand(1, generator=g)
    assert key.hex() not in str(info.value)


def _state_with_counter(g, counter):
    raw = bytearray(bytes(g.get_state().numpy()))
    raw[24:41] = counter.to_bytes(17, "little")  # the documented state layout
    return torch.frombuffer(raw, dtype=torch.uint8)


def test_counter_exhaustion_raises_and_leaves_the_state_alone():
    g = csprng.create_generator(1)
    g.set_state(_state_with_counter(g, 2**128 - 1))
    torch.rand(4, generator=g)  # exactly the last block
    with pytest.raises(CounterExhausted):
        torch.rand(4, generator=g)
    assert g.counter == 2**128


def test_torch_kernels_reached_without_ember_refuse_the_generator():
    g = csprng.create_generator(1)
    # torch's own kernel, bypassing ember's routing: there is no inherited state to draw from
    with pytest.raises(TypeError):
        torch._C._VariableFunctions.rand(3, generator=g)
    assert g.counter == 0
    assert issubclass(InheritedStateUsed, RuntimeError)  # the old name still imports
    torch.rand(3, generator=g)  # the generator keeps working


def test_supports_cuda_matches_torch():
    assert csprng.supports_cuda() == torch.cuda.is_available()


posix_only = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32",
                                reason="needs os.fork")


def _child_draw(g) -> list[int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        os.write(w, pickle.dumps(draw(g, 8).tolist()))
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(data)


@posix_only
def test_random_device_stream_differs_between_parent_and_forked_child():
    g = csprng.create_random_device_generator()
    child = g.spawn(1)[0]
    in_child = _child_draw(g)
    assert draw(g, 8).tolist() != in_child
    in_child_spawned = _child_draw(child)
    assert draw(child, 8).tolist() != in_child_spawned


@posix_only
def test_seeded_stream_continues_identically_in_a_forked_child():
    # documented: deterministic generators are not re-keyed; use fold_in(worker_id) per worker
    g = csprng.create_generator(11)
    in_child = _child_draw(g)
    assert draw(g, 8).tolist() == in_child


def test_import_is_light_and_needs_neither_dynamo_nor_triton():
    import subprocess

    code = ("import sys, ember.csprng; "
            "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_chacha20_generators_are_available_and_differ_from_aes():
    a = csprng.create_generator(3, cipher="chacha20")
    assert a.cipher == "chacha20"
    assert not torch.equal(draw(a), draw(csprng.create_generator(3)))
    b = csprng.Generator().set_state(a.get_state())
    assert torch.equal(draw(a), draw(b))
