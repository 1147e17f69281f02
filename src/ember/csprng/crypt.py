"""Encrypting tensors: torchcsprng's ``encrypt``/``decrypt`` and an authenticated AES-GCM mode.

``encrypt``/``decrypt`` follow torchcsprng (``shared/specs/torchcsprng-stream.md``): the raw bytes
of the input's elements, in element order, are zero-padded to whole 16-byte blocks and run through
AES-128 in ECB mode or in CTR mode with the counter block ``LE64(idx) || 8 zero bytes`` (idx from 0,
no nonce). Neither mode authenticates and both leak equal blocks (ECB) or repeat a keystream for
every message under one key (CTR). They exist for compatibility.

:func:`encrypt_gcm` / :func:`decrypt_gcm` are the mode to use: AES-GCM with a fresh 96-bit nonce
and a 128-bit tag, so tampering is detected and one key serves many messages.

Devices: CPU tensors go through OpenSSL (``cryptography``). For CUDA tensors ``encrypt``/``decrypt``
run AES-128 on the GPU with a Triton kernel (``cuda_backend.aes_crypt_``), so the data never
leaves the device; without triton they fall back to a copy through the host. AES-GCM always runs
on the host: a CUDA input is copied to the CPU, sealed by OpenSSL and the ciphertext (or the
plaintext, for :func:`decrypt_gcm`) is returned on the input's device. ``input`` and ``output``
must be on the same device; the 16-byte key may be on either (it is read on the host, where the
AES key schedule is computed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .views import flat_view

__all__ = ["GCMCiphertext", "decrypt", "decrypt_gcm", "encrypt", "encrypt_gcm",
           "gcm_associated_data", "view_as"]

BLOCK = 16
_CIPHERS = ("aes128",)
_MODES = ("ecb", "ctr")
_GCM_KEY_BYTES = (16, 32)


# ---------------------------------------------------------------------- argument checks
def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a strided (dense) tensor, got layout {t.layout}")
    return t


def _check_device(**tensors: torch.Tensor) -> None:
    """The one place where devices are checked: the CPU or a CUDA device."""
    for name, t in tensors.items():
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} must be on the CPU or a CUDA device, got device {t.device}")


def _refuse_host_route(op: str, *tensors: torch.Tensor | bytes) -> None:
    """Refuse a call on CUDA tensors during CUDA graph capture: the capture cannot hold its host
    work (reading the data or key, uploading a key table), and a replay would reuse its result
    (for GCM, its nonce)."""
    from .torch_adapter import _refuse_capture

    _refuse_capture(op, *tensors)


def _check_same_device(input: torch.Tensor, output: torch.Tensor) -> None:
    if input.device != output.device:
        raise ValueError(
            f"input is on {input.device} but output is on {output.device}: encrypt/decrypt write "
            "on the input's device; allocate output there (e.g. torch.empty(..., "
            "device=input.device)) or move one of them with .to()"
        )


def _kernels_for(t: torch.Tensor) -> bool | None:
    """How ``encrypt``/``decrypt`` process tensors on ``t``'s device.

    None: on the host with OpenSSL (CPU tensors, and CUDA tensors when triton is missing, copied
    through the host); False: the compiled Triton kernel on the device; True: the same kernel under
    Triton's interpreter (tests set this for CPU tensors).
    """
    if t.device.type == "cuda":
        from .cuda_backend import triton_available

        return False if triton_available() else None
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw_bytes(name: str, t: torch.Tensor) -> np.ndarray:
    """The tensor's element bytes in element order, as a uint8 array (a copy if not contiguous)."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.detach().contiguous()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    if not t.is_cpu:
        t = t.cpu()
    return flat_view(t.view(-1).view(torch.uint8))


def _key_bytes(key: object, expected: tuple[int, ...]) -> bytes:
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
    else:
        k = _check_tensor("key", key)
        _check_device(key=k)
        raw = _raw_bytes("key", k).tobytes()
    if len(raw) not in expected:
        want = " or ".join(str(n) for n in expected)
        raise ValueError(f"key: expected a {want}-byte key, got {len(raw)} bytes")
    return raw


def _check_cipher_mode(cipher: object, mode: object) -> None:
    if cipher not in _CIPHERS:
        raise ValueError(f"cipher: expected one of {_CIPHERS}, got {cipher!r}")
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {_MODES}, got {mode!r}")


def _check_output(output: torch.Tensor) -> None:
    if not output.is_contiguous():
        raise ValueError("output must be contiguous (its bytes are written in element order)")
    if output.is_conj() or output.is_neg():
        raise ValueError("output must not be a conjugate or negative view")


# ---------------------------------------------------------------------- torchcsprng semantics
def _ctr_keystream(key: bytes, nblocks: int) -> bytes:
    counters = np.zeros((nblocks, 2), dtype="<u8")
    counters[:, 0] = np.arange(nblocks, dtype=np.uint64)
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return enc.update(counters.tobytes()) + enc.finalize()


def _transform(data: np.ndarray, key: bytes, mode: str, inverse: bool) -> np.ndarray:
    """AES over ``data`` (a whole number of blocks) in torchcsprng's ``mode``."""
    if data.size == 0:
        return data
    if mode == "ecb":
        ctx = Cipher(algorithms.AES(key), modes.ECB())
        op = ctx.decryptor() if inverse else ctx.encryptor()
        return np.frombuffer(op.update(data.tobytes()) + op.finalize(), np.uint8)
    stream = np.frombuffer(_ctr_keystream(key, data.size // BLOCK), np.uint8)
    return np.bitwise_xor(data, stream)


def _write(output: torch.Tensor, data: np.ndarray) -> None:
    if data.size:
        output.view(-1).view(torch.uint8).copy_(torch.from_numpy(data.copy()))


# ---------------------------------------------------------------------- on the device
def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes in element order as a flat uint8 tensor on its device."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.detach().contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.view(-1).view(torch.uint8)


def _words(b: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``b`` (uint8) zero-padded to ``nbytes`` as int32 words: a view when it already is that."""
    if b.numel() == nbytes and b.data_ptr() % 4 == 0:
        return b.view(torch.int32)
    w = torch.zeros(nbytes // 4, dtype=torch.int32, device=b.device)
    w.view(torch.uint8)[: b.numel()].copy_(b)
    return w


def _device_crypt(
    src: torch.Tensor,
    output: torch.Tensor,
    key: bytes,
    mode: str,
    inverse: bool,
    padded: int,
    interpret: bool,
) -> None:
    """``output``'s bytes = the first bytes of AES over ``src``'s bytes padded to ``padded``."""
    from .cuda_backend import aes_crypt_

    words = _words(_device_bytes(src), padded)
    dst_bytes = _device_bytes(output)  # output is contiguous: a view of its bytes
    n_out = dst_bytes.numel()
    direct = n_out == padded and dst_bytes.data_ptr() % 4 == 0
    dst = dst_bytes.view(torch.int32) if direct else torch.empty_like(words)
    aes_crypt_(words, dst, key, mode, inverse, interpret)
    if not direct and n_out:
        dst_bytes.copy_(dst.view(torch.uint8)[:n_out])


def _checked(input, output, key, cipher: str, mode: str,
             op: str) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    """The checks shared by encrypt and decrypt: (input, output, raw 16-byte key)."""
    input, output = _check_tensor("input", input), _check_tensor("output", output)
    _check_tensor("key", key)
    _check_device(input=input, output=output, key=key)
    _check_same_device(input, output)
    _check_cipher_mode(cipher, mode)
    # CUDA tensors: refused during graph capture on every route (the host reads them, or the
    # first call with a key uploads its table from the host, which a capture cannot hold)
    _refuse_host_route(f"ember.csprng.{op}", input, key)
    raw_key = _key_bytes(key, (16,))
    _check_output(output)
    return input, output, raw_key


def encrypt(
    input: torch.Tensor, output: torch.Tensor, key: torch.Tensor, cipher: str = "aes128", mode: str = "ecb"
) -> torch.Tensor:
    """Encrypt ``input``'s bytes into ``output`` with torchcsprng's semantics; returns ``output``.

    ``output`` must hold exactly ``input``'s byte count rounded up to a multiple of 16 (the last
    block is zero-padded); ``key`` is any tensor of exactly 16 bytes. ``input`` and ``output`` must be
    on the same device; CUDA tensors are encrypted there by a Triton kernel. Unauthenticated: prefer
    :func:`encrypt_gcm`.
    """
    input, output, raw_key = _checked(input, output, key, cipher, mode, "encrypt")
    n_in = _nbytes(input)
    padded = -(-n_in // BLOCK) * BLOCK
    if _nbytes(output) != padded:
        raise ValueError(
            f"output: expected {padded} bytes (input's {n_in} bytes rounded up to a "
            f"multiple of {BLOCK}), got {_nbytes(output)} bytes"
        )
    kern = _kernels_for(input)
    if kern is not None:
        _device_crypt(input, output, raw_key, mode, False, padded, kern)
        return output
    data = np.zeros(padded, np.uint8)
    data[:n_in] = _raw_bytes("input", input)
    _write(output, _transform(data, raw_key, mode, inverse=False))
    return output


def decrypt(
    input: torch.Tensor, output: torch.Tensor, key: torch.Tensor, cipher: str = "aes128", mode: str = "ecb"
) -> torch.Tensor:
    """Decrypt ``input`` (a multiple of 16 bytes) into ``output``; returns ``output``.

    ``output`` may be up to 15 bytes shorter than ``input``: the trailing padding is dropped.
    """
    input, output, raw_key = _checked(input, output, key, cipher, mode, "decrypt")
    n_in, n_out = _nbytes(input), _nbytes(output)
    if n_in % BLOCK:
        raise ValueError(f"input: expected a multiple of {BLOCK} bytes, got {n_in} bytes")
    if not 0 <= n_in - n_out < BLOCK:
        raise ValueError(
            f"output: expected {n_in - BLOCK + 1} to {n_in} bytes (input's {n_in} "
            f"bytes less at most {BLOCK - 1} of padding), got {n_out} bytes"
        )
    kern = _kernels_for(input)
    if kern is not None:
        _device_crypt(input, output, raw_key, mode, True, n_in, kern)
        return output
    plain = _transform(_raw_bytes("input", input), raw_key, mode, inverse=True)
    _write(output, plain[:n_out])
    return output


# ---------------------------------------------------------------------- authenticated mode
@dataclass(frozen=True)
class GCMCiphertext:
    """An AES-GCM encrypted tensor: ciphertext bytes (uint8 tensor), 12-byte nonce, 16-byte tag,
    plus the plaintext's dtype and shape. dtype and shape are authenticated with the data
    (see :func:`gcm_associated_data`): a relabelled ciphertext fails to decrypt."""

    ciphertext: torch.Tensor
    nonce: bytes
    tag: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __iter__(self):
        # unpacks as (ciphertext, nonce, tag)
        return iter((self.ciphertext, self.nonce, self.tag))


_GCM_LABEL = b"ember.csprng/gcm/v1\x00"


def gcm_associated_data(dtype: torch.dtype, shape: tuple[int, ...] | torch.Size,
                        associated_data: bytes | None = None) -> bytes:
    """The associated data that AES-GCM authenticates for a tensor of ``dtype`` and ``shape``.

    ``"ember.csprng/gcm/v1" || 0x00 || str(dtype) (ASCII) || 0x00 || LE32(ndim) ||
    LE64(size) per dimension || LE64(len(associated_data)) || associated_data``.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must not have negative sizes, got {dims}")
    user = b"" if associated_data is None else associated_data
    head = _GCM_LABEL + str(dtype).encode("ascii") + b"\x00" + len(dims).to_bytes(4, "little")
    head += b"".join(d.to_bytes(8, "little") for d in dims)
    return head + len(user).to_bytes(8, "little") + user


def encrypt_gcm(
    input: torch.Tensor,
    key: torch.Tensor | bytes,
    *,
    nonce: bytes | None = None,
    associated_data: bytes | None = None,
) -> GCMCiphertext:
    """Encrypt and authenticate ``input``'s bytes with AES-GCM (16-byte key: AES-128, 32: AES-256).

    Runs on the host (OpenSSL): a CUDA input is copied to the CPU, and the ciphertext tensor is
    returned on the input's device. A fresh random 12-byte nonce is used unless one is given;
    never reuse a nonce with a key.
    ``associated_data`` is authenticated but not encrypted, and so are the input's dtype and
    shape (the exact bytes are :func:`gcm_associated_data`).
    """
    input = _check_tensor("input", input)
    _check_device(input=input)
    _refuse_host_route("ember.csprng.encrypt_gcm", input, key)
    raw_key = _key_bytes(key, _GCM_KEY_BYTES)
    if nonce is None:
        nonce = os.urandom(12)
    nonce = _check_bytes("nonce", nonce, 12)
    user = None if associated_data is None else _check_bytes("associated_data", associated_data)
    aad = gcm_associated_data(input.dtype, tuple(input.shape), user)
    sealed = AESGCM(raw_key).encrypt(nonce, _raw_bytes("input", input).tobytes(), aad)
    body, tag = sealed[:-16], sealed[-16:]
    ct = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
    return GCMCiphertext(ct.to(input.device), nonce, tag, input.dtype, tuple(input.shape))


def decrypt_gcm(
    ciphertext: torch.Tensor | GCMCiphertext,
    key: torch.Tensor | bytes,
    nonce: bytes | None = None,
    tag: bytes | None = None,
    *,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | torch.Size | None = None,
    associated_data: bytes | None = None,
) -> torch.Tensor:
    """Verify and decrypt; returns the plaintext with its original dtype and shape.

    Pass a :class:`GCMCiphertext`, or the ciphertext tensor with its nonce, tag, ``dtype=`` and
    ``shape=``. dtype and shape are authenticated: a ciphertext relabelled with another dtype or
    shape fails like a tampered one. Runs on the host; the plaintext comes back on the
    ciphertext's device. Raises ValueError if the tag does not match (wrong key, nonce, dtype,
    shape, associated data or tampered bytes).
    """
    if isinstance(ciphertext, GCMCiphertext):
        if nonce is not None or tag is not None or dtype is not None or shape is not None:
            raise TypeError(
                "decrypt_gcm: nonce, tag, dtype and shape come from the GCMCiphertext; don't "
                "pass them separately"
            )
        sealed = ciphertext
        ciphertext, nonce, tag, dtype, shape = (sealed.ciphertext, sealed.nonce, sealed.tag,
                                                sealed.dtype, sealed.shape)
    elif dtype is None or shape is None:
        raise TypeError("decrypt_gcm: dtype= and shape= are required with a ciphertext tensor "
                        "(they are authenticated with the data)")
    ct = _check_tensor("ciphertext", ciphertext)
    _check_device(ciphertext=ct)
    _refuse_host_route("ember.csprng.decrypt_gcm", ct, key)
    if nonce is None or tag is None:
        raise TypeError("decrypt_gcm: nonce and tag are required with a ciphertext tensor")
    raw_key = _key_bytes(key, _GCM_KEY_BYTES)
    nonce = _check_bytes("nonce", nonce, 12)
    tag = _check_bytes("tag", tag, 16)
    user = None if associated_data is None else _check_bytes("associated_data", associated_data)
    aad = gcm_associated_data(dtype, tuple(shape), user)
    try:
        plain = AESGCM(raw_key).decrypt(nonce, _raw_bytes("ciphertext", ct).tobytes() + tag, aad)
    except InvalidTag:
        raise ValueError(
            "decrypt_gcm: authentication failed (wrong key, nonce, tag, dtype, shape or "
            "associated data, or the ciphertext was modified)"
        ) from None
    data = (torch.frombuffer(bytearray(plain), dtype=torch.uint8) if plain
            else torch.empty(0, dtype=torch.uint8))
    return view_as(data, dtype, tuple(shape)).to(ct.device)


def view_as(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Reinterpret a uint8 byte tensor as ``dtype`` with ``shape`` (no copy)."""
    data = _check_tensor("data", data)
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"data must be a 1-D uint8 tensor, got {data.dtype} with {data.dim()} dims")
    shape = tuple(int(s) for s in shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    want = itemsize * int(np.prod(shape, dtype=np.int64)) if shape else itemsize
    if data.numel() != want:
        raise ValueError(
            f"data: expected {want} bytes for {dtype} of shape {shape}, got {data.numel()} bytes"
        )
    if want == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    return data.view(dtype).view(shape)


def _check_bytes(name: str, value: object, length: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if length is not None and len(value) != length:
        raise ValueError(f"{name}: expected {length} bytes, got {len(value)} bytes")
    return value
