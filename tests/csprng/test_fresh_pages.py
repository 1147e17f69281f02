"""Fresh factory outputs of ember generators ask for transparent huge pages (Linux), with the same
values as draws into preallocated outputs."""

import os
import subprocess
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


_ADVICE_CHECK = """
import os, sys
import torch
import ember.csprng as csprng
from ember.csprng import pages
sys.path.insert(0, {here!r})
from test_fresh_pages import _vm_flags

MiB = 1 << 20
g = csprng.create_generator(3)
big = torch.rand(4 * MiB, generator=g)  # 16 MiB, a fresh output: advised
lo, _ = pages.huge_page_span(big.data_ptr(), big.numel() * 4)
plain = torch.empty(4 * MiB)  # torch's own allocation, never advised by ember
lo_plain, _ = pages.huge_page_span(plain.data_ptr(), plain.numel() * 4)
pages.ADVISE_BYTES = 1 << 62
off = torch.rand(4 * MiB, generator=g)  # advice switched off
lo_off, _ = pages.huge_page_span(off.data_ptr(), off.numel() * 4)
print("hg" in _vm_flags(lo), "hg" in _vm_flags(lo_plain), "hg" in _vm_flags(lo_off),
      bool(big.min() >= 0 and big.max() < 1))
"""


@pytest.mark.skipif(not _thp_usable(), reason="needs Linux with transparent huge pages not 'never'")
def test_a_large_fresh_output_is_advised_and_a_small_one_or_a_plain_tensor_is_not():
    # In a fresh interpreter: in a long test process the C allocator reuses freed memory that an earlier
    # advised output left marked, so a plain allocation's mapping can carry the flag by history.
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = _ADVICE_CHECK.format(here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    advised, plain, off, in_range = done.stdout.split()
    assert (advised, plain, off, in_range) == ("True", "False", "False", "True")


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
