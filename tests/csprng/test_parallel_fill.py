"""Large draws split across threads give exactly the values of one thread."""

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import distributions

DRAWS = {
    "rand": lambda g, n: torch.rand(n, generator=g),
    "randn f64": lambda g, n: torch.randn(n, generator=g, dtype=torch.float64),
    "randint": lambda g, n: torch.randint(-7, 1000, (n,), generator=g),
    "randint wide": lambda g, n: torch.randint(0, 3 * 2**40, (n,), generator=g),
    "bernoulli": lambda g, n: torch.empty(n).bernoulli_(0.3, generator=g),
    "exponential": lambda g, n: torch.empty(n).exponential_(generator=g),
    "geometric": lambda g, n: torch.empty(n).geometric_(0.2, generator=g),
}


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("n", [4097, 50_001])
def test_threaded_fill_equals_single_thread(monkeypatch, name, n):
    draw = DRAWS[name]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        g = csprng.create_generator(21)
        want, want_counter = draw(g, n), g.counter
        # force the parallel path at this small size: tiny chunks, several per thread
        monkeypatch.setattr(distributions, "PARALLEL_BYTES", 1024)
        monkeypatch.setattr(distributions, "CHUNK_BYTES", 1024)
        monkeypatch.setattr(distributions, "PARALLEL_CHUNK_BYTES", 4096)
        monkeypatch.setattr(distributions, "_threads", lambda nbytes: 3)
        g = csprng.create_generator(21)
        got = draw(g, n)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(want, got)
    assert g.counter == want_counter


def test_error_in_a_shared_chunk_reaches_the_caller(monkeypatch):
    # every chunk but the first fails, wherever it runs: the caller gets the error, no thread hangs
    calls = []

    def body(a, b, w):
        calls.append(a)
        if a:
            raise ZeroDivisionError(f"chunk at {a}")

    g = csprng.create_generator(4)
    n = 64 * 1024
    draw = g._stream.draw(distributions.blocks_for(n * 4))
    with pytest.raises(ZeroDivisionError, match="chunk at"):
        distributions._share_chunks(draw, n, 1, distributions.np.uint32, body, 4096, 3)
    assert 0 in calls and len(calls) < n * 4 // 4096  # claims stop after the first failure


def test_shared_chunks_cover_every_item_once():
    seen = []
    g = csprng.create_generator(5)
    n = 10_001  # not a whole number of chunks
    draw = g._stream.draw(distributions.blocks_for(n * 8))
    distributions._share_chunks(draw, n, 1, distributions.np.uint64,
                                lambda a, b, w: seen.append((a, b, len(w))), 1024, 3)
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == n
    assert all(x[1] == y[0] for x, y in zip(seen, seen[1:], strict=False))
    assert all(b - a == size for a, b, size in seen)


def _no_sharing(*args, **kwargs):
    raise AssertionError("a draw was split across threads")


def test_one_torch_thread_keeps_large_draws_on_the_calling_thread(monkeypatch):
    threads = torch.get_num_threads()
    g = csprng.create_generator(3)
    want = torch.rand(1 << 20, generator=g)  # 4 MiB of keystream: above PARALLEL_BYTES
    monkeypatch.setattr(distributions, "_share_chunks", _no_sharing)
    try:
        torch.set_num_threads(1)
        assert distributions._threads(1 << 30) == 1
        g = csprng.create_generator(3)
        got = torch.rand(1 << 20, generator=g)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(want, got)


def test_a_process_pinned_to_one_cpu_draws_on_one_thread(monkeypatch):
    if hasattr(distributions.os, "sched_getaffinity"):  # Linux: the mask, not the machine, counts
        monkeypatch.setattr(distributions.os, "sched_getaffinity", lambda pid: {0})
    else:
        monkeypatch.setattr(distributions.os, "cpu_count", lambda: 1)
    assert distributions._usable_cpus() == 1
    assert distributions._threads(1 << 30) == 1
    monkeypatch.setattr(distributions, "_share_chunks", _no_sharing)
    g = csprng.create_generator(3)
    x = torch.randn(1 << 20, generator=g)
    assert x.shape == (1 << 20,) and bool(x.isfinite().all())


def test_small_draws_use_one_thread_and_large_ones_up_to_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(distributions, "_usable_cpus", lambda: 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert distributions._threads(distributions.PARALLEL_BYTES - 1) == 1
        assert distributions._threads(distributions.PARALLEL_BYTES) == 2
    finally:
        torch.set_num_threads(threads)
