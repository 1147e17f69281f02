"""The fast NVIDIA path (CUDA C through NVRTC): compiled here, host logic with launches recorded,
the CUDA-graph capture refusal; the ``cuda`` tests compare it with the CPU stream on a GPU."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from fake_cuda import cuda

import ember.csprng as csprng
from ember.csprng import cuda_backend, cuda_fast, nvrtc_kernels
from ember.csprng.distributions import NativeSampler, blocks_for
from ember.csprng.stream import BlockStream

KEY = bytes(range(16))
CIPHERS = ["aes128", "chacha20"]
needs_nvrtc = pytest.mark.skipif(not nvrtc_kernels.available(), reason="cuda-bindings/NVRTC not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------- without a GPU
@needs_nvrtc
def test_a_kernel_compiles_alone_for_sm90_and_its_cubin_is_cached(tmp_path, monkeypatch):
    """Kernels are compiled one by one (the first draw waits for one); every kernel is compiled
    in test_every_fast_path_kernel_compiles_for_sm90."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    cubin = nvrtc_kernels.compile_cubin("sm_90", "ember_chacha_uniform")
    assert cubin[:4] == b"\x7fELF"  # a cubin is an ELF file
    assert b"ember_chacha_uniform" in cubin and b"ember_aes_uniform" not in cubin
    cached = list((tmp_path / "cubin").iterdir())
    assert len(cached) == 1 and cached[0].read_bytes() == cubin
    # a second call reads the file (a changed file would be returned as is)
    cached[0].write_bytes(b"marker")
    assert nvrtc_kernels.compile_cubin("sm_90", "ember_chacha_uniform") == b"marker"
    with pytest.raises(ValueError, match="no kernel"):
        nvrtc_kernels.compile_cubin("sm_90", "ember_nothing")


@needs_nvrtc
def test_cache_key_depends_on_arch_and_source(monkeypatch):
    a, b = nvrtc_kernels.cache_key("sm_90"), nvrtc_kernels.cache_key("sm_80")
    assert a != b and nvrtc_kernels.cache_key("sm_90", "ember_aes_normal") != a
    monkeypatch.setattr(nvrtc_kernels, "source", lambda: "// other")
    assert nvrtc_kernels.cache_key("sm_90") != a


def test_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    assert nvrtc_kernels.cache_dir() == tmp_path / "cubin"
    monkeypatch.delenv("EMBER_CACHE_DIR")
    assert "ember" in str(nvrtc_kernels.cache_dir())


def test_params_layout_matches_the_kernel_struct():
    # struct Params in nvrtc_source.cu: 44 + 4 words, 3 int64, 3 uint64, 4 double, 5 pointers, 6 int
    assert nvrtc_kernels.ctypes.sizeof(nvrtc_kernels.Params) == 176 + 16 + 24 + 24 + 32 + 40 + 24
    assert nvrtc_kernels.Params.n.offset == 192 and nvrtc_kernels.Params.skip.offset == 312


class FakeLauncher:
    """Records launches instead of running them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict]] = []

    def resident_blocks(self, device: int, name: str) -> int:
        return 32

    def launch(self, device, name, grid, params, stream) -> None:
        p = {f: getattr(params, f) for f, _ in params._fields_}
        p["key"], p["ctr"], p["ip"], p["fp"] = (list(p[k]) for k in ("key", "ctr", "ip", "fp"))
        self.calls.append((name, grid, p))


@pytest.fixture
def fake():
    rec = FakeLauncher()
    old = cuda_fast.set_launcher(rec)
    yield rec
    cuda_fast.set_launcher(old)


CASES = [
    ("uniform_", torch.float32, (), 4),
    ("uniform_", torch.float16, (), 2),
    ("uniform_", torch.float64, (-1.0, 2.0), 8),
    ("normal_", torch.float32, (), 4),
    ("normal_", torch.float64, (1.0, 3.0), 8),
    ("log_normal_", torch.bfloat16, (), 4),
    ("exponential_", torch.float32, (2.0,), 4),
    ("random_range_", torch.int64, (0, 1 << 20), 4),
    ("random_range_", torch.int64, (0, 3 << 30), 4),
    ("random_range_", torch.int64, (0, (1 << 40) + 1), 8),
    ("bernoulli_", torch.bool, (0.3,), 8),
]


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("method,dtype,params,wb", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_host_logic_reserves_what_the_cpu_reserves(fake, cipher, method, dtype, params, wb):
    n = 40_001
    cpu = NativeSampler(BlockStream(KEY, 6, cipher))
    getattr(cpu, method)(torch.empty(n, dtype=dtype), *params)
    s = NativeSampler(BlockStream(KEY, 6, cipher))
    cuda_fast.fast_fill_(s, torch.empty(n, dtype=dtype), method, params)
    assert s.stream.counter == cpu.stream.counter
    name, grid, p = fake.calls[0]
    op = {"uniform_": "uniform", "normal_": "normal", "log_normal_": "normal", "exponential_": "exponential",
          "random_range_": "integer", "bernoulli_": "bernoulli"}[method]
    assert name == f"ember_{'aes' if cipher == 'aes128' else 'chacha'}_{op}"
    assert p["n"] == n and p["wb"] == wb and 1 <= grid <= 32
    first = 6 if cipher == "aes128" else 6 // 4
    assert p["ctr"] == [first, 0, 0, 0] and p["skip"] == (0 if cipher == "aes128" else 6 % 4)
    assert p["key"] == list(cuda_fast.key_words(cipher, KEY))
    if op != "normal":
        words = n if op != "normal" else 0
        assert p["nunits"] == blocks_for(words * wb)
    else:
        assert p["pairs"] == (n + 1) // 2
    rejecting = method == "random_range_" and params[1] & (params[1] - 1)
    assert [c[0].rsplit("_", 1)[1] for c in fake.calls] == [op, "refill"] if rejecting else [op]


def test_refill_uses_the_draws_reject_stream(fake):
    from ember.csprng.stream import derive_key

    s = NativeSampler(BlockStream(KEY, 100))
    cuda_fast.fast_fill_(s, torch.empty(1000, dtype=torch.int64), "random_range_", (0, 3 << 30))
    (_, _, fill), (name, grid, refill) = fake.calls
    assert name == "ember_aes_refill" and grid == 1
    assert refill["key"] == list(cuda_fast.key_words("aes128", derive_key(KEY, "reject", 100)))
    assert refill["ctr"] == [0, 0, 0, 0] and refill["ip"] == fill["ip"] == [3 << 30, (1 << 32) % (3 << 30), 0]


def test_small_calls_copy_nothing_to_the_device(fake, monkeypatch):
    """Parameters travel in the launch: no tensor is created from Python values per call."""
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    s = NativeSampler(BlockStream(KEY, 0))
    for method, dtype, params, _ in CASES[:7]:
        cuda_fast.fast_fill_(s, torch.empty(1000, dtype=dtype), method, params)
    cuda_fast.fast_fill_(s, torch.empty(1000, dtype=dtype), "uniform_", ())
    made.clear()  # the first calls fill the caches of rounded constants
    for method, dtype, params, _ in CASES[:7]:
        cuda_fast.fast_fill_(s, torch.empty(1000, dtype=dtype), method, params)
    assert made == [] and len(fake.calls) == 15


def _launched_kernels() -> set[str]:
    """The names of the kernels the host side launches, over every fill it handles (recorded)."""
    rec = FakeLauncher()
    old = cuda_fast.set_launcher(rec)
    try:
        for cipher in CIPHERS:
            s = NativeSampler(BlockStream(KEY, 3, cipher))
            for method, dtype, params, _ in CASES:
                cuda_fast.fast_fill_(s, torch.empty(1000, dtype=dtype), method, params)
            cuda_fast.fast_fill_(s, torch.empty(1000, dtype=torch.int32), "random_", ())
            cuda_fast.normal_multi_(s, [torch.empty(10), torch.empty(7, dtype=torch.float64)], 0.0, 2.0)
        cuda_fast.secure_noise_(NativeSampler(BlockStream(KEY, 0)), [torch.empty(33)], 1.5)
    finally:
        cuda_fast.set_launcher(old)
    return {name for name, _, _ in rec.calls}


def _elf_cuda(blob: bytes) -> bool:
    """Whether ``blob`` is a 64-bit ELF file for NVIDIA CUDA (e_machine EM_CUDA = 190)."""
    machine = int.from_bytes(blob[18:20], "little")
    return len(blob) > 64 and blob[:4] == b"\x7fELF" and blob[4] == 2 and machine == 190


@needs_nvrtc
def test_every_fast_path_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    """Every kernel the fast path launches compiles with NVRTC (no GPU needed), one by one as at
    run time, into a CUDA ELF that holds that kernel's entry point and no other kernel."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    assert _launched_kernels() == set(nvrtc_kernels.KERNELS)
    for name in nvrtc_kernels.KERNELS:
        cubin = nvrtc_kernels.compile_cubin("sm_90", name)
        assert _elf_cuda(cubin), name
        # extern "C": the entry point's symbol is the kernel's own name, NUL-terminated
        assert name.encode() + b"\0" in cubin, name
        others = [k for k in nvrtc_kernels.KERNELS if k != name and k.encode() + b"\0" in cubin]
        assert others == [], (name, others)
    cached = sorted((tmp_path / "cubin").iterdir())
    assert len(cached) == len(nvrtc_kernels.KERNELS) and all(f.stat().st_size > 0 for f in cached)


class _NoGpuDriver:
    """The driver calls a kernel load reaches before its compilation fails."""

    def cuCtxSetCurrent(self, ctx):
        return (0,)

    def cuModuleLoadData(self, cubin):  # looked up before its argument is compiled; never called
        raise AssertionError("a cubin was loaded")


@pytest.fixture
def broken_nvrtc(tmp_path, monkeypatch):
    """The real driver launcher on a pretend device whose architecture NVRTC refuses (a real NVRTC
    compile failure), the Triton fallback run by Triton's interpreter and recorded, a fresh
    "fast path broken" flag, and the NVRTC path not forced."""
    if not nvrtc_kernels.available() or importlib.util.find_spec("triton") is None:
        pytest.skip("needs cuda-bindings/NVRTC and triton")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EMBER_CSPRNG_CUDA", raising=False)
    monkeypatch.setattr(cuda_backend, "_FAST_BROKEN", [])
    lch = nvrtc_kernels.DriverLauncher()
    lch._driver = _NoGpuDriver()
    lch._contexts[0], lch._arch[0], lch._sms[0] = None, "sm_1", 1
    old = cuda_fast.set_launcher(lch)
    compiles, fallback = [], []
    real_compile, real_triton = nvrtc_kernels._nvrtc_compile, cuda_backend.triton_fill_

    def compile_(arch, kernel):
        compiles.append(kernel)
        return real_compile(arch, kernel)

    def triton(sampler, tensor, method, params, interpret=None):
        fallback.append(method)
        return real_triton(sampler, tensor.as_subclass(torch.Tensor), method, params, interpret=True)

    monkeypatch.setattr(nvrtc_kernels, "_nvrtc_compile", compile_)
    monkeypatch.setattr(cuda_backend, "triton_fill_", triton)
    yield compiles, fallback
    cuda_fast.set_launcher(old)


def test_a_kernel_that_fails_to_load_warns_once_and_triton_fills(broken_nvrtc):
    compiles, fallback = broken_nvrtc
    g, h = csprng.create_generator(5), csprng.create_generator(5)
    a = cuda(torch.empty(300))
    b = cuda(torch.empty(301, dtype=torch.int64))
    with pytest.warns(RuntimeWarning, match=r"NVRTC path is unavailable \(.*NVRTC compilation for sm_1"
                      ) as caught:
        a.uniform_(generator=g)
        b.random_(0, 3 << 30, generator=g)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert compiles == ["ember_aes_uniform"]  # tried once, never again
    assert cuda_backend._FAST_BROKEN and cuda_backend.fast_path() == "triton"
    assert fallback == ["uniform_", "random_range_"]  # both draws filled by the Triton path
    # the failed attempt reserved nothing: the values are the CPU stream's from the start
    x, y = torch.empty(300), torch.empty(301, dtype=torch.int64)
    x.uniform_(generator=h)
    y.random_(0, 3 << 30, generator=h)
    assert torch.equal(a.as_subclass(torch.Tensor), x) and torch.equal(b.as_subclass(torch.Tensor), y)
    assert g.get_state().equal(h.get_state())
    assert not list((nvrtc_kernels.cache_dir()).glob("*.cubin"))  # no failed cubin cached


def test_a_foreach_kernel_that_fails_to_load_warns_once_and_triton_fills(broken_nvrtc):
    """normal_foreach_'s one-launch kernel failing marks the fast path broken as a fill does,
    instead of being compiled again on every call."""
    compiles, fallback = broken_nvrtc
    g, h = csprng.create_generator(6), csprng.create_generator(6)
    shapes = [(3, 5), (7,), (2, 2)]
    ts = [cuda(torch.empty(s)) for s in shapes]
    with pytest.warns(RuntimeWarning, match=r"NVRTC path is unavailable \(.*NVRTC compilation for sm_1"
                      ) as caught:
        csprng.normal_foreach_(ts, 1.5, generator=g)
        csprng.normal_foreach_(ts[:2], 2.0, generator=g)
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert compiles == ["ember_aes_normal_multi"]
    assert fallback == ["normal_"] * 5
    want = [torch.empty(s) for s in shapes]
    for t in want:
        t.normal_(0.0, 1.5, generator=h)
    for t in want[:2]:
        t.normal_(0.0, 2.0, generator=h)
    assert g.get_state().equal(h.get_state())
    for t, w in zip(ts, want, strict=True):
        torch.testing.assert_close(t.as_subclass(torch.Tensor), w, rtol=1e-5, atol=1e-6)


def test_a_forced_nvrtc_path_that_fails_to_load_raises_on_every_draw(broken_nvrtc, monkeypatch):
    """``EMBER_CSPRNG_CUDA=nvrtc`` (tests, benchmarks) never quietly runs another path: each
    draw raises, naming the setting, before anything is reserved; no warning is repeated."""
    compiles, fallback = broken_nvrtc
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "nvrtc")
    g = csprng.create_generator(7)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would be raised instead of the error
            with pytest.raises(RuntimeError, match=r"EMBER_CSPRNG_CUDA=nvrtc forces the NVRTC path, "
                               r"which is unavailable here \(.*NVRTC compilation for sm_1"):
                cuda(torch.empty(300)).uniform_(generator=g)
            with pytest.raises(RuntimeError, match="EMBER_CSPRNG_CUDA=nvrtc"):
                csprng.normal_foreach_([cuda(torch.empty(3))], 1.0, generator=g)
    assert fallback == [] and g.counter == 0 and not cuda_backend._FAST_BROKEN
    assert compiles == ["ember_aes_uniform", "ember_aes_normal_multi"] * 2


def test_draw_during_graph_capture_is_refused(monkeypatch):
    g = csprng.create_generator(1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(cuda_backend.CaptureError, match="CUDA graph"):
        cuda_backend.cuda_fill(g.sampler(), torch.empty(4), "uniform_", ())
    assert g.counter == 0  # nothing was drawn


def test_fast_path_can_be_forced(monkeypatch):
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "triton")
    assert cuda_backend.fast_path() == "triton"
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "cpu")
    assert cuda_backend.fast_path() == "cpu"


# ---------------------------------------------------------------------------- on a GPU
def _pair(method, dtype, params, n, cipher, counter=0, path="nvrtc", monkeypatch=None):
    """(CPU values, GPU values) from the same stream position; the counters must agree."""
    if monkeypatch is not None:
        monkeypatch.setenv("EMBER_CSPRNG_CUDA", path)
    g_cpu = csprng.create_generator(99, cipher=cipher)
    g_gpu = csprng.create_generator(99, cipher=cipher)
    for g in (g_cpu, g_gpu):
        g.sampler().stream.reset(g.sampler().stream.key, counter)
    cpu = torch.empty(n, dtype=dtype)
    gpu = torch.empty(n, dtype=dtype, device="cuda")
    name = method.replace("random_range_", "random_")
    getattr(cpu, name)(*params, generator=g_cpu)
    getattr(gpu, name)(*params, generator=g_gpu)
    torch.cuda.synchronize()
    assert g_cpu.get_state().equal(g_gpu.get_state())
    return cpu, gpu.cpu()


@needs_cuda
@pytest.mark.cuda
def test_cuda_every_nvrtc_kernel_loads_and_the_fast_path_is_used(monkeypatch):
    """On this GPU the NVRTC path is not silently replaced by Triton."""
    monkeypatch.delenv("EMBER_CSPRNG_CUDA", raising=False)
    assert nvrtc_kernels.available()
    fns = cuda_fast.launcher().functions(torch.cuda.current_device(), nvrtc_kernels.KERNELS)
    assert len(fns) == len(nvrtc_kernels.KERNELS)
    torch.rand(10, device="cuda", generator=csprng.create_generator(0))
    assert cuda_backend.fast_path() == "nvrtc" and not cuda_backend._FAST_BROKEN


EXACT = [
    ("uniform_", torch.float32, ()), ("uniform_", torch.float32, (-2.0, 3.0)),
    ("uniform_", torch.float64, ()), ("uniform_", torch.float64, (-2.0, 3.0)),
    ("uniform_", torch.float16, ()), ("uniform_", torch.float16, (-2.0, 3.0)),
    ("uniform_", torch.bfloat16, ()), ("uniform_", torch.bfloat16, (-1.0, 7.0)),
    ("uniform_", torch.float32, (1.5, 1.5)),
    ("random_range_", torch.int64, (-5, 2**31 + 1)), ("random_range_", torch.int64, (-(2**62), 2**62 + 7)),
    ("random_range_", torch.int64, (0, 2**32)), ("random_range_", torch.int64, (3, 3 + 2**40)),
    ("random_range_", torch.int64, (-(2**63), 2**63)), ("random_range_", torch.int32, (-1000, 1000)),
    ("random_range_", torch.int16, (0, 16)), ("random_range_", torch.uint8, (0, 200)),
    ("random_range_", torch.float32, (-1000, 1000)), ("random_range_", torch.float64, (0, 2**40 + 3)),
    ("random_range_", torch.float16, (-5, 5)), ("random_range_", torch.bfloat16, (0, 100)),
    ("random_range_", torch.bool, (0, 2)), ("random_range_", torch.int64, (0, 1000)),
    *[("random_", d, ()) for d in [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                    torch.float16, torch.bfloat16, torch.float32, torch.float64]],
    *[("bernoulli_", d, (0.3,)) for d in [torch.bool, torch.uint8, torch.int64, torch.float16,
                                           torch.bfloat16, torch.float32, torch.float64]],
    ("bernoulli_", torch.float32, (0.0,)), ("bernoulli_", torch.float32, (1.0,)),
    ("bernoulli_", torch.int32, (1e-12,)),
]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("counter", [5, 2**34 - 7])
@pytest.mark.parametrize("n", [1, 17, 100_003])
@pytest.mark.parametrize("case", EXACT, ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in EXACT])
def test_cuda_fast_path_is_bit_identical(monkeypatch, cipher, counter, n, case):
    method, dtype, params = case
    cpu, gpu = _pair(method, dtype, params, n, cipher, counter, monkeypatch=monkeypatch)
    assert torch.equal(cpu, gpu)


def _ulp(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    # ulp distance on the float grid of the dtype (monotone integer mapping of the bit patterns)
    bits = {torch.float32: (np.int32, np.float32), torch.float64: (np.int64, np.float64)}
    if a.dtype in (torch.float16, torch.bfloat16):
        ia = a.view(torch.int16).numpy().astype(np.int64)
        ib = b.view(torch.int16).numpy().astype(np.int64)
    else:
        it, _ = bits[a.dtype]
        ia = a.numpy().view(it).astype(np.int64)
        ib = b.numpy().view(it).astype(np.int64)
    low = np.int64((1 << (8 * a.element_size() - 1)) - 1)  # all bits but the sign
    ia = np.where(ia < 0, -(ia & low), ia)
    ib = np.where(ib < 0, -(ib & low), ib)
    return np.abs(ia - ib)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("n", [1, 999, 2 * 16384 * 2 + 77, 300_001])
@pytest.mark.parametrize("method,params", [("normal_", ()), ("normal_", (0.5, 2.0)), ("exponential_", ())])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_fast_path_transcendental_within_bounds(monkeypatch, cipher, n, method, params, dtype):
    """float32: 6 ulp (docs/csprng-stream.md, GPU column; affine normals: the bound on z * std
    plus the result's own ulp); float16/bfloat16: 1 ulp."""
    cpu, gpu = _pair(method, dtype, params, n, cipher, 3, monkeypatch=monkeypatch)
    d = _ulp(cpu, gpu)
    if dtype != torch.float32:
        assert d.max() <= 1
    elif params:
        z = (cpu.double() - params[0]) / params[1]
        tol = 6 * np.spacing(np.abs(z.numpy() * params[1]).astype(np.float32)) + np.spacing(
            np.abs(cpu.numpy()).astype(np.float32))
        assert (np.abs(cpu.double().numpy() - gpu.double().numpy()) <= tol).all()
    else:
        assert d.max() <= 6


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
def test_cuda_fast_path_float64_normal_close_and_log_normal(monkeypatch, cipher):
    cpu, gpu = _pair("normal_", torch.float64, (), 100_001, cipher, 9, monkeypatch=monkeypatch)
    assert _ulp(cpu, gpu).max() <= 12
    cpu, gpu = _pair("log_normal_", torch.float32, (0.0, 1.0), 100_001, cipher, 9, monkeypatch=monkeypatch)
    rel = (cpu.double() - gpu.double()).abs() / cpu.double().abs()
    assert float(rel.max()) < 1e-5


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
def test_cuda_fast_path_equals_triton_path_for_uniform_and_integers(monkeypatch, cipher):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton missing")
    cases = [("uniform_", torch.float32, ()), ("random_range_", torch.int64, (0, 3 << 30))]
    for method, dtype, params in cases:
        _, fast = _pair(method, dtype, params, 50_001, cipher, 11, "nvrtc", monkeypatch)
        _, slow = _pair(method, dtype, params, 50_001, cipher, 11, "triton", monkeypatch)
        assert torch.equal(fast, slow)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cipher", CIPHERS)
def test_cuda_bernoulli_tensor_p_and_non_contiguous(monkeypatch, cipher):
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "nvrtc")
    p = torch.rand(513, 7, dtype=torch.float64)
    g1, g2 = csprng.create_generator(4, cipher=cipher), csprng.create_generator(4, cipher=cipher)
    a = torch.empty(513, 7).bernoulli_(p, generator=g1)
    b = torch.empty(513, 7, device="cuda").bernoulli_(p.cuda(), generator=g2)
    assert torch.equal(a, b.cpu())
    x = torch.empty(64, 80)[:, ::3]
    y = torch.empty(64, 80, device="cuda")[:, ::3]
    x.uniform_(generator=g1)
    y.uniform_(generator=g2)
    assert torch.equal(x, y.cpu())


@needs_cuda
@pytest.mark.cuda
def test_cuda_normal_foreach_equals_per_tensor_calls(monkeypatch):
    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "nvrtc")
    shapes = [(1, 1), (64, 3, 7, 7), (1, 1), (64,), (512, 256), (3,)]
    g1, g2 = csprng.create_generator(8), csprng.create_generator(8)
    a = [torch.empty(s, device="cuda") for s in shapes]
    b = [torch.empty(s, device="cuda") for s in shapes]
    for t in a:
        t.normal_(0.0, 1.3, generator=g1)
    csprng.normal_foreach_(b, 1.3, generator=g2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and g1.counter == g2.counter


@needs_cuda
@pytest.mark.cuda
def test_cuda_draws_from_other_threads(monkeypatch):
    """Launches from a thread that made no CUDA call before (no current context there yet)."""
    import threading

    monkeypatch.setenv("EMBER_CSPRNG_CUDA", "nvrtc")
    x = torch.empty(5000, device="cuda")
    y = torch.empty(5000, device="cuda", dtype=torch.int64)
    g = csprng.create_generator(21)
    errors = []

    def work():
        try:
            x.normal_(generator=g)
            y.random_(0, 3 << 30, generator=g)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    h = csprng.create_generator(21)
    a, b = torch.empty(5000), torch.empty(5000, dtype=torch.int64)
    a.normal_(generator=h)
    b.random_(0, 3 << 30, generator=h)
    assert torch.equal(b, y.cpu()) and float((a - x.cpu()).abs().max()) < 1e-5


@needs_cuda
@pytest.mark.cuda
def test_cuda_graph_capture_is_refused():
    g = csprng.create_generator(1)
    x = torch.empty(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(cuda_backend.CaptureError), torch.cuda.graph(graph):
        x.uniform_(generator=g)
    assert g.counter == 0


@needs_cuda
@pytest.mark.cuda
def test_cuda_rejection_heavy_range_on_many_values(monkeypatch):
    """A quarter of the words rejected, over 4 M values: every refill lands where the CPU puts it."""
    cpu, gpu = _pair("random_range_", torch.int64, (0, 3 << 30), 4_000_037, "aes128", 1,
                     monkeypatch=monkeypatch)
    assert torch.equal(cpu, gpu)
