"""encrypt/decrypt with torchcsprng semantics against pycryptodome, and the AES-GCM mode."""

from __future__ import annotations

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


DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
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
    assert element_bytes(out) == ref_encrypt(element_bytes(x.contiguous()), bytes(KEY.numpy()),
                                             "ctr")


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
        encrypt(torch.zeros(16, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8),
                torch.zeros(12, dtype=torch.uint8))


@pytest.mark.parametrize("kw,match", [({"cipher": "aes256"}, "cipher"),
                                      ({"mode": "cbc"}, "mode")])
def test_unknown_cipher_or_mode(kw, match):
    with pytest.raises(ValueError, match=match):
        encrypt(torch.zeros(16, dtype=torch.uint8), torch.empty(16, dtype=torch.uint8), KEY, **kw)


def test_wrong_encrypt_output_length():
    with pytest.raises(ValueError, match="output: expected 32 bytes"):
        encrypt(torch.zeros(17, dtype=torch.uint8), torch.empty(17, dtype=torch.uint8), KEY)


@pytest.mark.parametrize("n_in,n_out,match", [(17, 17, "multiple of 16"),
                                              (32, 16, "output"), (16, 17, "output")])
def test_wrong_decrypt_lengths(n_in, n_out, match):
    with pytest.raises(ValueError, match=match):
        decrypt(torch.zeros(n_in, dtype=torch.uint8), torch.empty(n_out, dtype=torch.uint8), KEY)


def test_non_contiguous_output_is_rejected():
    out = torch.empty(8, 4, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="contiguous"):
        encrypt(torch.zeros(32, dtype=torch.uint8), out, KEY)


@pytest.mark.parametrize("arg", ["input", "output", "key"])
def test_non_tensor_arguments(arg):
    args = {"input": torch.zeros(16, dtype=torch.uint8),
            "output": torch.empty(16, dtype=torch.uint8), "key": KEY}
    args[arg] = b"0123456789abcdef"
    with pytest.raises(TypeError, match=arg):
        encrypt(args["input"], args["output"], args["key"])


def test_cuda_and_other_devices_are_refused():
    meta = torch.empty(16, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="CPU"):
        encrypt(meta, torch.empty(16, dtype=torch.uint8), KEY)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_message_points_to_the_cuda_backend():
    with pytest.raises(ValueError, match="CUDA backend"):
        encrypt(torch.zeros(16, dtype=torch.uint8, device="cuda"),
                torch.empty(16, dtype=torch.uint8), KEY)


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
    assert element_bytes(plain) == element_bytes(x)
    back = crypt.view_as(crypt.decrypt_gcm(ct, key, nonce, tag, associated_data=b"hdr"),
                         sealed.dtype, sealed.shape)
    assert back.dtype == dtype and torch.equal(back, x)


def test_gcm_matches_pycryptodome():
    key, nonce = bytes(range(16)), bytes(range(12))
    x = torch.arange(10, dtype=torch.int16)
    ct, _, tag = crypt.encrypt_gcm(x, key, nonce=nonce, associated_data=b"ad")
    ref = AES.new(key, AES.MODE_GCM, nonce=nonce)
    ref.update(b"ad")
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
        crypt.decrypt_gcm(ct, key, nonce, tag, associated_data=aad)


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
        crypt.decrypt_gcm(ct, KEY, nonce, tag[:8])
    with pytest.raises(TypeError, match="nonce and tag"):
        crypt.decrypt_gcm(ct, KEY)
    with pytest.raises(ValueError, match="expected 12 bytes for torch.float32"):
        crypt.view_as(crypt.decrypt_gcm(ct, KEY, nonce, tag), torch.float32, (3,))


def test_gcm_empty_input():
    sealed = crypt.encrypt_gcm(torch.empty(0), KEY)
    plain = crypt.decrypt_gcm(sealed, KEY)
    assert plain.numel() == 0
    assert crypt.view_as(plain, torch.float32, (0, 3)).shape == (0, 3)
