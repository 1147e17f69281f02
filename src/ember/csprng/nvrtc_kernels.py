"""The fast NVIDIA path: CUDA C kernels (nvrtc_source.cu) compiled at run time by NVRTC.

This module holds what is independent of any GPU: the source text, its compilation to a cubin for a
given architecture (NVRTC runs without a GPU) with an on-disk cache, the launch parameters as a
``ctypes`` structure that mirrors the kernels' ``Params``, and the driver-API launcher (loaded only
on a machine with a GPU). The bindings are NVIDIA's ``cuda-bindings`` (``cuda.bindings.nvrtc`` and
``cuda.bindings.driver``) with the ``nvidia-cuda-nvrtc`` library; without them nothing here is
importable-critical: :func:`available` says False and ember uses the Triton path.

Cache: compiled cubins are kept under ``EMBER_CACHE_DIR`` (environment) or the user cache directory
(``$XDG_CACHE_HOME/ember`` or ``~/.cache/ember`` on Linux, ``~/Library/Caches/ember`` on macOS,
``%LOCALAPPDATA%\\ember\\Cache`` on Windows), in ``cubin/``, named by the SHA-256 of the source, the
architecture, the NVRTC version and the compile options.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

NT = 256  # threads per block (the kernels' NT)
GROUP = 16384  # normal pairs per group (distributions.NORMAL_GROUP)
OPTIONS = ("--fmad=false", "--std=c++17", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")
KERNELS = tuple(
    f"ember_{c}_{op}"
    for c in ("aes", "chacha")
    for op in ("uniform", "exponential", "integer", "bernoulli", "normal", "refill", "normal_multi")
) + ("ember_aes_secure_noise",)

# output kinds and flags (nvrtc_source.cu)
K_F32, K_F64, K_F16, K_BF16, K_I64, K_I32, K_I16, K_I8, K_U8 = range(9)
F_SHIFT, F_CLAMP, F_POW2, F_PTENSOR, F_AFFINE, F_LOG, F_ALIGNED, F_F64 = (1 << i for i in range(8))


class Params(ctypes.Structure):
    """The kernels' ``struct Params`` (same fields, order and natural alignment)."""

    _fields_ = [
        ("key", ctypes.c_uint32 * 44),
        ("ctr", ctypes.c_uint32 * 4),
        ("n", ctypes.c_int64),
        ("nunits", ctypes.c_int64),
        ("pairs", ctypes.c_int64),
        ("ip", ctypes.c_uint64 * 3),
        ("fp", ctypes.c_double * 4),
        ("out", ctypes.c_void_p),
        ("p", ctypes.c_void_p),
        ("cnt", ctypes.c_void_p),
        ("pos", ctypes.c_void_p),
        ("err", ctypes.c_void_p),
        ("skip", ctypes.c_int),
        ("wb", ctypes.c_int),
        ("mbits", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("cap", ctypes.c_int),
    ]


class Desc(ctypes.Structure):
    """The kernels' ``struct Desc``: one tensor of a ``normal_multi`` launch."""

    _fields_ = [
        ("ctr", ctypes.c_uint32 * 4),
        ("n", ctypes.c_int64),
        ("pairs", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("fp", ctypes.c_double * 4),
        ("first_block", ctypes.c_int64),
        ("nblocks", ctypes.c_int64),
        ("skip", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("wb", ctypes.c_int),
        ("mbits", ctypes.c_int),
        ("pad", ctypes.c_int),
    ]


class Desc4(ctypes.Structure):
    """The kernels' ``struct Desc4``: one tensor of a ``secure_noise`` launch."""

    _fields_ = [
        ("ctr", (ctypes.c_uint32 * 4) * 4),
        ("n", ctypes.c_int64),
        ("pairs", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("first_block", ctypes.c_int64),
        ("nblocks", ctypes.c_int64),
    ]


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether NVRTC and the driver bindings can be imported (says nothing about a GPU)."""
    return _spec("cuda.bindings") and _nvrtc_loadable()


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=1)
def _nvrtc_loadable() -> bool:
    try:
        from cuda.bindings import nvrtc

        err, _, _ = nvrtc.nvrtcVersion()
        return int(err) == 0
    except Exception:  # a missing libnvrtc raises from inside the bindings
        return False


@lru_cache(maxsize=1)
def source() -> str:
    """The CUDA C source, with the AES T-table filled in."""
    from .cuda_backend import aes_tables

    t0 = aes_tables()[:256]
    text = (Path(__file__).with_name("nvrtc_source.cu")).read_text()
    return text.replace("@T0@", ", ".join(f"0x{int(v):08X}u" for v in t0))


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check_nvrtc(err, "nvrtcVersion")
    return int(major), int(minor)


def _check_nvrtc(err: Any, what: str, prog: Any = None) -> None:
    if int(err) == 0:
        return
    log = ""
    if prog is not None:
        from cuda.bindings import nvrtc

        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.decode(errors="replace")
    raise RuntimeError(f"ember.csprng: NVRTC {what} failed ({err}){': ' + log if log else ''}")


def cache_dir() -> Path:
    """Where compiled cubins are kept (``EMBER_CACHE_DIR`` overrides the user cache directory)."""
    env = os.environ.get("EMBER_CACHE_DIR")
    if env:
        return Path(env) / "cubin"
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local")) / "ember" / "Cache"
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches" / "ember"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"
    return base / "cubin"


def cache_key(arch: str, kernel: str | None = None) -> str:
    """SHA-256 of everything the cubin depends on: source, kernel, architecture, NVRTC version,
    options."""
    h = hashlib.sha256()
    for part in (source(), kernel or "all", arch, "{}.{}".format(*nvrtc_version()), *OPTIONS):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_cubin(arch: str, kernel: str | None = None, *, use_cache: bool = True) -> bytes:
    """The cubin of ``kernel`` (one of :data:`KERNELS`; None: all of them) for ``arch`` (e.g.
    ``"sm_90"``), from the disk cache if it is there. Kernels are compiled one by one on first use:
    the first draw of a process waits for one kernel, not for all."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"no kernel named {kernel!r}")
    path = cache_dir() / f"{cache_key(arch, kernel)}-{arch}.cubin"
    if use_cache:
        try:
            return path.read_bytes()
        except OSError:
            pass
    cubin = _nvrtc_compile(arch, kernel)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)  # atomic: concurrent processes never read a partial file
        except OSError:
            pass  # a read-only or full cache only costs a compile next time
    return cubin


def _nvrtc_compile(arch: str, kernel: str | None) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source().encode(), b"ember_csprng.cu", 0, [], [])
    _check_nvrtc(err, "nvrtcCreateProgram")
    try:
        which = f"-DEMBER_K_{kernel}" if kernel else "-DEMBER_ALL"
        opts = [f"--gpu-architecture={arch}".encode(), which.encode(), *(o.encode() for o in OPTIONS)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _check_nvrtc(err, f"compilation for {arch}", prog)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check_nvrtc(err, "nvrtcGetCUBINSize")
        buf = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check_nvrtc(err, "nvrtcGetCUBIN")
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---------------------------------------------------------------------------- launching
class DriverLauncher:
    """Loads each kernel (compiled on first use) into the device's primary context, the one torch
    uses, and launches kernels on torch's current stream."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self._functions: dict[tuple[int, str], Any] = {}
        self._handles: dict[tuple[int, str], int] = {}
        self._resident: dict[tuple[int, str], int] = {}
        self._contexts: dict[int, Any] = {}
        self._c_launch = _c_launch_kernel()
        self._modules: list[Any] = []
        self._sms: dict[int, int] = {}
        self._arch: dict[int, str] = {}
        self._lock = threading.Lock()

    def functions(self, device: int, names: tuple[str, ...]) -> list[Any]:
        """The kernels ``names`` on ``device``, compiled and loaded if they are not yet."""
        out = []
        for name in names:
            fn = self._functions.get((device, name))
            if fn is None:
                with self._lock:
                    fn = self._functions.get((device, name))
                    if fn is None:
                        fn = self._functions[(device, name)] = self._load(device, name)
            out.append(fn)
        return out

    def _context(self, device: int) -> str:
        import torch

        if device not in self._arch:
            drv = self._driver
            torch.cuda.init()
            _check(drv.cuInit(0)[0], "cuInit")
            err, dev = drv.cuDeviceGet(device)
            _check(err, "cuDeviceGet")
            err, ctx = drv.cuDevicePrimaryCtxRetain(dev)  # the context torch uses
            _check(err, "cuDevicePrimaryCtxRetain")
            _check(drv.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
            self._contexts[device] = ctx
            major, minor = torch.cuda.get_device_capability(device)
            self._sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
            self._arch[device] = f"sm_{major}{minor}"
        return self._arch[device]

    def _load(self, device: int, name: str) -> Any:
        drv = self._driver
        arch = self._context(device)
        _check(drv.cuCtxSetCurrent(self._contexts[device])[0], "cuCtxSetCurrent")  # this thread's
        err, mod = drv.cuModuleLoadData(compile_cubin(arch, name))
        _check(err, f"cuModuleLoadData({name})")
        self._modules.append(mod)
        err, fn = drv.cuModuleGetFunction(mod, name.encode())
        _check(err, f"cuModuleGetFunction({name})")
        err, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, NT, 0)
        _check(err, f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
        self._resident[(device, name)] = max(1, int(per_sm)) * self._sms[device]
        self._handles[(device, name)] = int(fn)
        return fn

    def resident_blocks(self, device: int, name: str) -> int:
        """How many blocks of ``name`` the device runs at once (SMs x blocks per SM)."""
        n = self._resident.get((device, name))
        if n is None:
            self.functions(device, (name,))
            n = self._resident[(device, name)]
        return n

    def launch(self, device: int, name: str, grid: int, params: Params, stream: int) -> None:
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        handle = self._handles.get((device, name))
        if handle is None:
            self.functions(device, (name,))
            handle = self._handles[(device, name)]
        err = self._launch(device, name, handle, grid, argv, stream)
        if int(err) == _INVALID_CONTEXT:  # a thread on which nothing made the context current yet
            _check(self._driver.cuCtxSetCurrent(self._contexts[device])[0], "cuCtxSetCurrent")
            err = self._launch(device, name, handle, grid, argv, stream)
        _check(err, f"cuLaunchKernel({name})")

    def _launch(self, device: int, name: str, handle: int, grid: int, argv: Any, stream: int) -> Any:
        if self._c_launch is not None:  # the driver's C entry point: a microsecond per launch
            return self._c_launch(handle, grid, 1, 1, NT, 1, 1, 0, stream, ctypes.addressof(argv), None)
        fn = self._functions[(device, name)]
        (err,) = self._driver.cuLaunchKernel(
            fn, grid, 1, 1, NT, 1, 1, 0, self._driver.CUstream(stream), ctypes.addressof(argv), 0
        )
        return err


_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def _c_launch_kernel() -> Any:
    """``cuLaunchKernel`` of the CUDA driver library through ctypes (the same library and context
    that cuda-bindings and torch use), or None where it cannot be found."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for lib in names:
        try:
            fn = ctypes.CDLL(lib).cuLaunchKernel
        except (OSError, AttributeError):
            continue
        u, p = ctypes.c_uint, ctypes.c_void_p
        fn.argtypes = [p, u, u, u, u, u, u, u, p, p, p]
        fn.restype = ctypes.c_int
        return fn
    return None


def _check(err: Any, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"ember.csprng: CUDA driver call {what} failed ({err})")
