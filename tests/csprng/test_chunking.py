"""How a draw is cut into chunks, where its keystream is written and which scratch buffers it uses
never change its values: only the sizes drawn do."""

import threading

import numpy as np
import pytest
import torch

import ember.csprng as csprng
from ember.csprng import distributions

DRAWS = {
    "rand f32": lambda g, n: torch.rand(n, generator=g),
    "rand f64": lambda g, n: torch.rand(n, generator=g, dtype=torch.float64),
    "uniform f32": lambda g, n: torch.empty(n).uniform_(-2.5, 7.0, generator=g),
    "rand f16": lambda g, n: torch.rand(n, generator=g, dtype=torch.float16),
    "randn f32": lambda g, n: torch.randn(n, generator=g),
    "normal f64": lambda g, n: torch.empty(n, dtype=torch.float64).normal_(1.5, 2.0, generator=g),
    "log_normal f32": lambda g, n: torch.empty(n).log_normal_(0.2, 0.5, generator=g),
    "exponential f32": lambda g, n: torch.empty(n).exponential_(3.0, generator=g),
    "cauchy f64": lambda g, n: torch.empty(n, dtype=torch.float64).cauchy_(generator=g),
    "randint": lambda g, n: torch.randint(-7, 1000, (n,), generator=g),
    "randint int16": lambda g, n: torch.randint(0, 3000, (n,), generator=g, dtype=torch.int16),
    "bernoulli": lambda g, n: torch.empty(n).bernoulli_(0.3, generator=g),
}
SIZES = [1001, 40_001]  # one chunk, and several chunks of the forced small size


def _reference(name, n):
    """The draw with the default settings, with the output-as-words path turned off."""
    g = csprng.create_generator(99)
    return DRAWS[name](g, n), g.counter


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("n", SIZES)
def test_writing_the_keystream_into_the_output_changes_nothing(monkeypatch, name, n):
    g = csprng.create_generator(99)
    direct, direct_counter = DRAWS[name](g, n), g.counter
    monkeypatch.setattr(distributions._Sink, "words", lambda self, word, cd: None)
    g = csprng.create_generator(99)
    via_scratch = DRAWS[name](g, n)
    assert torch.equal(direct, via_scratch)
    assert g.counter == direct_counter


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("chunk", [1024, 1 << 16])
def test_chunk_size_changes_nothing(monkeypatch, name, chunk):
    n = SIZES[1]
    want, want_counter = _reference(name, n)
    monkeypatch.setattr(distributions, "CHUNK_BYTES", chunk)
    g = csprng.create_generator(99)
    got = DRAWS[name](g, n)
    assert torch.equal(want, got)
    assert g.counter == want_counter


def test_scratch_buffers_are_per_thread():
    # four threads draw at once, each from its own generator, reusing their scratch buffers; each
    # gets exactly what the same draws give one after another on one thread
    names = ["randn f32", "randint", "rand f64", "bernoulli"]
    n = 300_000  # several 1 MiB chunks for the 8-byte words

    def run(i, name, results):
        g = csprng.create_generator(1000 + i)
        results[i] = [DRAWS[name](g, n) for _ in range(3)]

    sequential = {}
    for i, name in enumerate(names):
        run(i, name, sequential)
    concurrent = {}
    threads = [threading.Thread(target=run, args=(i, name, concurrent)) for i, name in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(names)):
        assert all(torch.equal(a, b) for a, b in zip(sequential[i], concurrent[i], strict=True))


def test_scratch_is_reused_and_grows():
    a = distributions._tmp("test.slot", 10, np.float32)
    a[:] = 1.5
    b = distributions._tmp("test.slot", 20, np.float32)
    assert np.shares_memory(a, b)  # the same buffer, not a new allocation
    big = distributions._tmp("test.slot", distributions.CHUNK_BYTES, np.float64)
    assert big.size == distributions.CHUNK_BYTES and not np.shares_memory(a, big)
    other = distributions._tmp("test.other", 10, np.float32)
    assert not np.shares_memory(other, big)
