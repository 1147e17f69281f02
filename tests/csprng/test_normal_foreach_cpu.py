"""normal_foreach_ on CPU: the batched transform of many small tensors gives exactly the values and
the final stream position of one ``normal_`` call per tensor (torch's in-place call, ember's
generator), whatever the mix of sizes, dtypes and parameters."""

import pytest
import torch

import ember.csprng as csprng

GROUP_VALUES = 2 * 16384  # a tensor of up to this many values holds one group of normal pairs


def _per_call(shapes_dtypes, mean, std, seed):
    g = csprng.create_generator(seed, cipher="aes128")
    outs = [torch.empty(s, dtype=d) for s, d in shapes_dtypes]
    for t in outs:
        t.normal_(mean, std, generator=g)
    return outs, g.counter


def _foreach(shapes_dtypes, mean, std, seed):
    g = csprng.create_generator(seed, cipher="aes128")
    outs = [torch.full(s, float("nan"), dtype=d) for s, d in shapes_dtypes]
    csprng.normal_foreach_(outs, std, mean=mean, generator=g)
    return outs, g.counter


CASES = {
    "opacus-like": [((16, 1, 8, 8), torch.float32), ((16,), torch.float32), ((32, 16, 4, 4), torch.float32),
                    ((32,), torch.float32), ((32, 512), torch.float32), ((32,), torch.float32),
                    ((10, 32), torch.float32), ((10,), torch.float32), ((1, 1), torch.float32)],
    "odd sizes and group edges": [((n,), torch.float32) for n in
                                  (1, 2, 3, 7, 31, 33, 999, GROUP_VALUES - 1, GROUP_VALUES,
                                   GROUP_VALUES + 1, GROUP_VALUES + 2, 5)],
    "mixed dtypes": [((5,), torch.float64), ((6,), torch.float32), ((7,), torch.bfloat16),
                     ((9,), torch.float16), ((11,), torch.float64), ((0,), torch.float32),
                     ((3, 0), torch.float64), ((13,), torch.float32)],
    "a large tensor between small ones": [((17,), torch.float32), ((300_000,), torch.float32),
                                          ((19,), torch.float32), ((23,), torch.float64)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (0.5, 2.5), (-1.0, 0.0)])
def test_foreach_equals_one_call_per_tensor(case, mean, std):
    want, want_counter = _per_call(CASES[case], mean, std, seed=7)
    got, got_counter = _foreach(CASES[case], mean, std, seed=7)
    assert got_counter == want_counter
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a.shape, a.dtype)


def test_many_tensors_of_random_sizes_equal_per_call_draws():
    sizes = torch.randint(1, 3000, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = [((n,), torch.float32 if i % 3 else torch.float64) for i, n in enumerate(sizes)]
    want, wc = _per_call(spec, 0.0, 1.3, seed=11)
    got, gc = _foreach(spec, 0.0, 1.3, seed=11)
    assert gc == wc
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_views_with_an_offset_are_filled_in_place():
    base_a, base_b = torch.zeros(40), torch.zeros(40)
    g1, g2 = csprng.create_generator(2), csprng.create_generator(2)
    base_a[5:25].normal_(generator=g1)
    csprng.normal_foreach_([base_b[5:25]], generator=g2)
    assert torch.equal(base_a, base_b) and base_b[:5].eq(0).all() and base_b[25:].eq(0).all()


def test_foreach_in_inference_mode_gives_the_values_of_normal_():
    g1, g2 = csprng.create_generator(4), csprng.create_generator(4)
    with torch.inference_mode():
        one_by_one = [torch.empty(7).normal_(generator=g1), torch.empty(3).normal_(generator=g1)]
        together = csprng.normal_foreach_([torch.empty(7), torch.empty(3)], generator=g2)
    assert all(torch.equal(a, b) for a, b in zip(one_by_one, together, strict=True))
