"""Fresh factory outputs of ember generators ask for transparent huge pages (Linux), with the same
values as draws into preallocated outputs."""

import os
import sys
from pathlib import Path

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import pages

MiB = 1 << 20
H = pages.HUGE_PAGE


def _thp_usable() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and p.exists() and "[never]" not in p.read_text()


def _vm_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that contains ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_span_is_the_whole_huge_pages_inside():
    assert pages.huge_page_span(0, 2 * H) == (0, 2 * H)
    assert pages.huge_page_span(64, 2 * H) == (H, H)  # the partial pages at both ends are left out
    assert pages.huge_page_span(H - 1, H + 1) == (H, H)
    assert pages.huge_page_span(1, 2 * H - 2) is None
    assert pages.huge_page_span(3 * H, 0) is None


@pytest.mark.parametrize("make", [
    lambda g, **kw: torch.rand(2 * MiB, generator=g, **kw),
    lambda g, **kw: torch.randn(2 * MiB, generator=g, **kw),
    lambda g, **kw: torch.randint(-5, 1000, (MiB,), generator=g, dtype=torch.int64, **kw),
], ids=["rand", "randn", "randint"])
def test_fresh_outputs_have_the_values_of_preallocated_ones(make, monkeypatch):
    fresh = make(csprng.create_generator(11))
    buf = torch.empty_like(fresh)
    make(csprng.create_generator(11), out=buf)
    monkeypatch.setattr(pages, "ADVISE_BYTES", 0)
    unadvised = make(csprng.create_generator(11))
    assert torch.equal(fresh, buf) and torch.equal(fresh, unadvised)
    assert not torch.equal(fresh, make(csprng.create_generator(12)))


@pytest.mark.skipif(not _thp_usable(), reason="needs Linux with transparent huge pages not 'never'")
def test_a_large_fresh_output_is_advised_and_a_small_one_or_a_plain_tensor_is_not(monkeypatch):
    g = csprng.create_generator(3)
    big = torch.rand(4 * MiB, generator=g)  # 16 MiB
    lo, _ = pages.huge_page_span(big.data_ptr(), big.numel() * 4)
    assert "hg" in _vm_flags(lo)
    plain = torch.empty(4 * MiB)  # torch's own allocation, never advised by ember
    lo_plain, _ = pages.huge_page_span(plain.data_ptr(), plain.numel() * 4)
    if os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":  # then torch's allocator advises it itself
        assert "hg" not in _vm_flags(lo_plain)
    monkeypatch.setattr(pages, "ADVISE_BYTES", 0)
    off = torch.rand(4 * MiB, generator=g)
    lo_off, _ = pages.huge_page_span(off.data_ptr(), off.numel() * 4)
    assert "hg" not in _vm_flags(lo_off)
    assert big.min() >= 0 and big.max() < 1



def test_small_outputs_are_not_advised_and_large_ones_are(monkeypatch):
    calls = []
    monkeypatch.setattr(pages, "_madvise", lambda: calls.append(1) or None)
    pages.advise_fresh(torch.empty(pages.ADVISE_BYTES // 4 - 1))  # under the threshold
    assert calls == []
    pages.advise_fresh(torch.empty(pages.ADVISE_BYTES // 4))
    assert calls == [1]


def test_there_is_no_madvise_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    pages._madvise.cache_clear()
    try:
        assert pages._madvise() is None
        t = pages.advise_fresh(torch.empty(2 * MiB))
        assert t.numel() == 2 * MiB
    finally:
        monkeypatch.undo()
        pages._madvise.cache_clear()
