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
