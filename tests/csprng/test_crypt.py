"""encrypt/decrypt with torchcsprng semantics against pycryptodome, and the AES-GCM mode.

The Triton kernel that serves CUDA tensors is run on CPU tensors under Triton's interpreter by
pointing ``crypt._kernels_for`` at it (the ``kernel_path`` fixture) and compared with OpenSSL.
"""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest
import torch
from Crypto.Cipher import AES

from ember.csprng import crypt

encrypt, decrypt = crypt.encrypt, crypt.decrypt

KEY = torch.arange(16, dtype=torch.uint8) * 7 + 3


def element_bytes(x: torch.Tensor) -> bytes:
    return bytes(x.contiguous().view(-1).view(torch.uint8).numpy()) if x.numel() else b""


def ref_encrypt(data: bytes, key: bytes, mode: str) -> bytes:
    """pycryptodome: zero-pad to 16, ECB, or XOR with AES(LE64(idx) || 0^64)."""
    padded = data + b"\0" * (-len(data) % 16)
    aes = AES.new(key, AES.MODE_ECB)
    if mode == "ecb":
        return aes.encrypt(padded)
    ks = b"".join(aes.encrypt(struct.pack("<QQ", i, 0)) for i in range(len(padded) // 16))
    return bytes(a ^ b for a, b in zip(padded, ks, strict=True))


def sample(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=dtype)


DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
LENGTHS = [0, 1, 3, 7, 16, 33]


@pytest.mark.parametrize("mode", ["ecb", "ctr"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_encrypt_matches_pycryptodome_and_round_trips(mode, dtype, n):
    x = sample(dtype, n)
    nbytes = n * x.element_size()
    padded = -(-nbytes // 16) * 16
    out = torch.empty(padded // 8, dtype=torch.int64) if padded % 8 == 0 else None
    out = torch.empty(padded, dtype=torch.uint8) if out is None or n % 2 else out
    assert encrypt(x, out, KEY, "aes128", mode) is out
    assert element_bytes(out) == ref_encrypt(element_bytes(x), bytes(KEY.numpy()), mode)
    back = torch.empty_like(x)
    assert decrypt(out, back, KEY, "aes128", mode) is back
    assert element_bytes(back) == element_bytes(x)


def test_ctr_decrypt_is_the_same_operation_as_encrypt():
    x = torch.arange(32, dtype=torch.uint8)
    a, b = torch.empty(32, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    encrypt(x, a, KEY, mode="ctr")
    decrypt(x, b, KEY, mode="ctr")
    assert torch.equal(a, b)


def test_ecb_decrypt_uses_the_inverse_cipher():
    x = torch.arange(16, dtype=torch.uint8)
    out = torch.empty(16, dtype=torch.uint8)
    decrypt(x, out, KEY, mode="ecb")
    assert element_bytes(out) == AES.new(bytes(KEY.numpy()), AES.MODE_ECB).decrypt(bytes(range(16)))


def test_multidimensional_and_non_contiguous_input_use_element_order():
    x = torch.arange(48, dtype=torch.int32).reshape(6, 8).t()  # non-contiguous
    out = torch.empty(12, 4, dtype=torch.float32)
    encrypt(x, out, KEY, mode="ctr")
    assert element_bytes(out) == ref_encrypt(element_bytes(x.contiguous()), bytes(KEY.numpy()), "ctr")


def test_key_may_be_any_dtype_of_16_bytes():
    x = torch.arange(20, dtype=torch.uint8)
    a, b = torch.empty(32, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    encrypt(x, a, KEY, mode="ecb")
    encrypt(x, b, KEY.view(torch.int32).clone(), mode="ecb")
    assert torch.equal(a, b)


def test_decrypt_drops_padding_when_output_is_shorter():
    x = torch.arange(13, dtype=torch.uint8)
    enc = torch.empty(16, dtype=torch.uint8)
    encrypt(x, enc, KEY, mode="ecb")
    back = torch.empty(13, dtype=torch.uint8)
    decrypt(enc, back, KEY, mode="ecb")
    assert torch.equal(back, x)


# ---------------------------------------------------------------------- bad inputs
def test_wrong_key_size():
    with pytest.raises(ValueError, match="expected a 16-byte key, got 12 bytes"):
        encrypt(
            torch.zeros(16, dtype=torch.uint8),
            torch.empty(16, dtype=torch.uint8),
            torch.zeros(12, dtype=torch.uint8),
        )


@pytest.mark.parametrize("kw,match", [({"cipher": "aes256"}, "cipher"), ({"mode": "cbc"}, "mode")])
def test_unknown_cipher_or_mode(kw, match):
    with pytest.raises(ValueError, match=match):
        encrypt(torch.zeros(16, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8), KEY, **kw)


def test_wrong_encrypt_output_length():
    with pytest.raises(ValueError, match="output: expected 32 bytes"):
        encrypt(torch.zeros(17, dtype=torch.uint8), torch.empty(17, dtype=torch.uint8), KEY)


@pytest.mark.parametrize(
    "n_in,n_out,match", [(17, 17, "multiple of 16"), (32, 16, "output"), (16, 17, "output")]
)
def test_wrong_decrypt_lengths(n_in, n_out, match):
    with pytest.raises(ValueError, match=match):
        decrypt(torch.zeros(n_in, dtype=torch.uint8), torch.empty(n_out, dtype=torch.uint8), KEY)


def test_non_contiguous_output_is_rejected():
    out = torch.empty(8, 4, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous"):
        encrypt(torch.zeros(32, dtype=torch.uint8), out, KEY)


@pytest.mark.parametrize("arg", ["input", "output", "key"])
def test_non_tensor_arguments(arg):
    args = {
        "input": torch.zeros(16, dtype=torch.uint8),
        "output": torch.empty(16, dtype=torch.uint8),
        "key": KEY,
    }
    args[arg] = b"0123456789abcdef"
    with pytest.raises(TypeError, match=arg):
        encrypt(args["input"], args["output"], args["key"])


def test_devices_other_than_cpu_and_cuda_are_refused():
    meta = torch.empty(16, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="input must be on the CPU or a CUDA device"):
        encrypt(meta, torch.empty(16, dtype=torch.uint8), KEY)
    with pytest.raises(ValueError, match="output must be on the CPU or a CUDA device"):
        decrypt(torch.zeros(16, dtype=torch.uint8), meta, KEY)


# ---------------------------------------------------------------------- the device kernel
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def kernel_path(monkeypatch):
    """encrypt/decrypt on CPU tensors through the Triton kernel, under the interpreter."""
    calls = []

    def interpret(t):
        calls.append(t.device)
        return True

    monkeypatch.setattr(crypt, "_kernels_for", interpret)
    return calls


def _openssl(fn, *args, **kw):
    """fn on the CPU path even while kernel_path is active."""
    saved = crypt._kernels_for
    crypt._kernels_for = lambda t: None
    try:
        return fn(*args, **kw)
    finally:
        crypt._kernels_for = saved


@needs_triton
@pytest.mark.parametrize("mode", ["ecb", "ctr"])
@pytest.mark.parametrize(
    "dtype",
    [torch.uint8, torch.bool, torch.int16, torch.float32, torch.bfloat16, torch.float64, torch.complex64],
    ids=str,
)
@pytest.mark.parametrize("n", [0, 1, 3, 7, 16, 33, 1100])  # 1100 float32: 275 blocks, 2 programs
def test_kernel_matches_openssl_and_round_trips(kernel_path, mode, dtype, n):
    x = sample(dtype, n)
    padded = -(-n * x.element_size() // 16) * 16
    want = torch.empty(padded, dtype=torch.uint8)
    _openssl(encrypt, x, want, KEY, mode=mode)
    got = torch.empty(padded, dtype=torch.uint8)
    assert encrypt(x, got, KEY, "aes128", mode) is got
    assert torch.equal(got, want)
    assert element_bytes(got) == ref_encrypt(element_bytes(x), bytes(KEY.numpy()), mode)
    back = torch.empty_like(x)
    assert decrypt(got, back, KEY, "aes128", mode) is back
    assert element_bytes(back) == element_bytes(x)
    assert kernel_path  # the kernel ran


@needs_triton
@pytest.mark.parametrize("mode", ["ecb", "ctr"])
def test_kernel_unaligned_non_contiguous_short_and_in_place(kernel_path, mode):
    key = bytes(KEY.numpy())
    buf = torch.arange(200, dtype=torch.uint8)
    x = buf[1:38]  # 37 bytes at an odd address: padded to 48 in a fresh buffer
    big = torch.zeros(64, dtype=torch.uint8)
    out = big[3:51]  # output at an odd address: written through a copy
    encrypt(x, out, KEY, mode=mode)
    assert element_bytes(out) == ref_encrypt(element_bytes(x), key, mode)
    assert big[:3].eq(0).all() and big[51:].eq(0).all()  # nothing outside the output
    back = torch.empty(37, dtype=torch.uint8)  # shorter than the 48-byte input: padding dropped
    decrypt(out, back, KEY, mode=mode)
    assert torch.equal(back, x)
    t = torch.arange(48, dtype=torch.int32).reshape(6, 8).t()  # non-contiguous input
    ct = torch.empty(12, 4, dtype=torch.float32)
    encrypt(t, ct, KEY, mode=mode)
    assert element_bytes(ct) == ref_encrypt(element_bytes(t.contiguous()), key, mode)
    y = torch.arange(64, dtype=torch.uint8)
    want = ref_encrypt(element_bytes(y), key, mode)
    encrypt(y, y, KEY, mode=mode)  # in place
    assert element_bytes(y) == want


@needs_triton
def test_kernel_ecb_decrypt_is_the_inverse_cipher(kernel_path):
    x = torch.arange(16 * 40, dtype=torch.uint8)
    out = torch.empty_like(x)
    decrypt(x, out, KEY, mode="ecb")
    assert element_bytes(out) == AES.new(bytes(KEY.numpy()), AES.MODE_ECB).decrypt(element_bytes(x))


@needs_triton
def test_kernel_ctr_counter_carries_past_2_32_blocks():
    from ember.csprng.cuda_backend import aes_crypt_

    key = bytes(KEY.numpy())
    first = 2**32 - 3
    data = np.random.default_rng(1).integers(0, 256, 16 * 300, dtype=np.uint8)
    src = torch.from_numpy(data.copy()).view(torch.int32)
    dst = torch.empty_like(src)
    aes_crypt_(src, dst, key, "ctr", False, interpret=True, first_block=first)
    aes = AES.new(key, AES.MODE_ECB)
    ks = aes.encrypt(b"".join(struct.pack("<QQ", first + i, 0) for i in range(300)))
    assert element_bytes(dst) == bytes(a ^ b for a, b in zip(data.tobytes(), ks, strict=True))


@needs_cuda
def test_cuda_input_with_cpu_output_is_refused():
    with pytest.raises(ValueError, match="input is on cuda:0 but output is on cpu"):
        encrypt(torch.zeros(16, dtype=torch.uint8, device="cuda"), torch.empty(16, dtype=torch.uint8), KEY)
    with pytest.raises(ValueError, match="input is on cpu but output is on cuda"):
        decrypt(torch.zeros(16, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8, device="cuda"), KEY)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("mode", ["ecb", "ctr"])
@pytest.mark.parametrize("n", [1, 37, 4096, 3 * 2**20 + 5])
def test_cuda_matches_cpu(mode, n):
    x = torch.randint(0, 256, (n,), dtype=torch.uint8)
    padded = -(-n // 16) * 16
    want = encrypt(x, torch.empty(padded, dtype=torch.uint8), KEY, mode=mode)
    got = encrypt(x.cuda(), torch.empty(padded, dtype=torch.uint8, device="cuda"), KEY.cuda(), mode=mode)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    back = decrypt(got, torch.empty(n, dtype=torch.uint8, device="cuda"), KEY, mode=mode)
    assert torch.equal(back.cpu(), x)


@needs_cuda
def test_cuda_gcm_round_trips_on_the_device():
    x = torch.randn(5, 7, device="cuda")
    sealed = crypt.encrypt_gcm(x, KEY)
    assert sealed.ciphertext.device.type == "cuda"
    plain = crypt.decrypt_gcm(sealed, KEY)
    assert plain.device.type == "cuda"
    assert torch.equal(plain, x)


# ---------------------------------------------------------------------- AES-GCM
@pytest.mark.parametrize("key_len", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool])
def test_gcm_round_trip(key_len, dtype):
    key = torch.arange(key_len, dtype=torch.uint8)
    x = sample(dtype, 21).reshape(3, 7)
    sealed = crypt.encrypt_gcm(x, key, associated_data=b"hdr")
    ct, nonce, tag = sealed
    assert ct.dtype == torch.uint8 and ct.numel() == x.numel() * x.element_size()
    assert len(nonce) == 12 and len(tag) == 16
    plain = crypt.decrypt_gcm(sealed, key, associated_data=b"hdr")
    assert plain.dtype == dtype and torch.equal(plain, x)
    back = crypt.decrypt_gcm(ct, key, nonce, tag, dtype=sealed.dtype, shape=sealed.shape,
                             associated_data=b"hdr")
    assert back.dtype == dtype and torch.equal(back, x)


def test_gcm_matches_pycryptodome():
    key, nonce = bytes(range(16)), bytes(range(12))
    x = torch.arange(10, dtype=torch.int16)
    ct, _, tag = crypt.encrypt_gcm(x, key, nonce=nonce, associated_data=b"ad")
    ref = AES.new(key, AES.MODE_GCM, nonce=nonce)
    # the documented associated data: label, dtype, shape, then the caller's bytes
    ref.update(b"ember.csprng/gcm/v1\x00torch.int16\x00" + (1).to_bytes(4, "little")
               + (10).to_bytes(8, "little") + (2).to_bytes(8, "little") + b"ad")
    want_ct, want_tag = ref.encrypt_and_digest(element_bytes(x))
    assert element_bytes(ct) == want_ct and tag == want_tag


def test_gcm_nonces_are_fresh():
    x = torch.zeros(16, dtype=torch.uint8)
    a, b = crypt.encrypt_gcm(x, KEY), crypt.encrypt_gcm(x, KEY)
    assert a.nonce != b.nonce and not torch.equal(a.ciphertext, b.ciphertext)


@pytest.mark.parametrize("what", ["ciphertext", "tag", "nonce", "aad", "key"])
def test_gcm_detects_tampering(what):
    x = torch.arange(40, dtype=torch.uint8)
    ct, nonce, tag = crypt.encrypt_gcm(x, KEY, associated_data=b"a")
    key, aad = KEY, b"a"
    if what == "ciphertext":
        ct = ct.clone()
        ct[5] ^= 1
    elif what == "tag":
        tag = bytes([tag[0] ^ 1]) + tag[1:]
    elif what == "nonce":
        nonce = bytes([nonce[0] ^ 1]) + nonce[1:]
    elif what == "aad":
        aad = b"b"
    else:
        key = KEY.clone()
        key[0] ^= 1
    with pytest.raises(ValueError, match="authentication failed"):
        crypt.decrypt_gcm(ct, key, nonce, tag, dtype=torch.uint8, shape=(40,),
                          associated_data=aad)


def test_gcm_bad_inputs():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="expected a 16 or 32-byte key, got 24 bytes"):
        crypt.encrypt_gcm(x, torch.zeros(24, dtype=torch.uint8))
    with pytest.raises(ValueError, match="nonce: expected 12 bytes"):
        crypt.encrypt_gcm(x, KEY, nonce=b"short")
    with pytest.raises(TypeError, match="input"):
        crypt.encrypt_gcm(np.zeros(4), KEY)
    with pytest.raises(TypeError, match="associated_data"):
        crypt.encrypt_gcm(x, KEY, associated_data="text")
    ct, nonce, tag = crypt.encrypt_gcm(x, KEY)
    with pytest.raises(ValueError, match="tag: expected 16 bytes"):
        crypt.decrypt_gcm(ct, KEY, nonce, tag[:8], dtype=x.dtype, shape=x.shape)
    with pytest.raises(TypeError, match="nonce and tag"):
        crypt.decrypt_gcm(ct, KEY, dtype=x.dtype, shape=x.shape)
    with pytest.raises(TypeError, match="dtype= and shape= are required"):
        crypt.decrypt_gcm(ct, KEY, nonce, tag)
    with pytest.raises(ValueError, match="expected 12 bytes for torch.float32"):
        crypt.view_as(torch.zeros(16, dtype=torch.uint8), torch.float32, (3,))


def test_gcm_empty_input():
    sealed = crypt.encrypt_gcm(torch.empty(0), KEY)
    plain = crypt.decrypt_gcm(sealed, KEY)
    assert plain.numel() == 0 and plain.dtype == torch.float32 and plain.shape == (0,)
    assert crypt.view_as(torch.empty(0, dtype=torch.uint8), torch.float32, (0, 3)).shape == (0, 3)
