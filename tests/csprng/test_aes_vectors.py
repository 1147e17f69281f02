"""Published AES-128 test vectors: FIPS-197 Appendix C.1 and NIST SP 800-38A F.1.1 / F.5.1.

They check the ``cryptography`` backend itself and ember's ECB path (``crypt.encrypt``/``decrypt``).
"""

from __future__ import annotations

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ember.csprng import crypt

FIPS_KEY = bytes(range(16))
FIPS_PLAIN = bytes.fromhex("00112233445566778899aabbccddeeff")
FIPS_CIPHER = bytes.fromhex("69c4e0d86a7b0430d8cdb78070b4c55a")

SP_KEY = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
SP_PLAIN = bytes.fromhex(
    "6bc1bee22e409f96e93d7e117393172a"
    "ae2d8a571e03ac9c9eb76fac45af8e51"
    "30c81c46a35ce411e5fbc1191a0a52ef"
    "f69f2445df4f9b17ad2b417be66c3710")
SP_ECB = bytes.fromhex(
    "3ad77bb40d7a3660a89ecaf32466ef97"
    "f5d3d58503b9699de785895a96fdbaaf"
    "43b1cd7f598ece23881b00e3ed030688"
    "7b0c785e27e8ad3f8223207104725dd4")
SP_CTR_IV = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
SP_CTR = bytes.fromhex(
    "874d6191b620e3261bef6864990db6ce"
    "9806f66b7970fdff8617187bb9fffdff"
    "5ae4df3edbd5d35e5b4f09020db03eab"
    "1e031dda2fbe03d1792170a0f3009cee")


def t(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def test_fips197_c1_backend():
    enc = Cipher(algorithms.AES(FIPS_KEY), modes.ECB()).encryptor()
    assert enc.update(FIPS_PLAIN) + enc.finalize() == FIPS_CIPHER


def test_fips197_c1_through_encrypt_and_decrypt_ecb():
    out = torch.empty(16, dtype=torch.uint8)
    crypt.encrypt(t(FIPS_PLAIN), out, t(FIPS_KEY), "aes128", "ecb")
    assert bytes(out.numpy()) == FIPS_CIPHER
    back = torch.empty(16, dtype=torch.uint8)
    crypt.decrypt(out, back, t(FIPS_KEY), "aes128", "ecb")
    assert bytes(back.numpy()) == FIPS_PLAIN


def test_sp800_38a_f11_ecb_backend():
    enc = Cipher(algorithms.AES(SP_KEY), modes.ECB()).encryptor()
    assert enc.update(SP_PLAIN) + enc.finalize() == SP_ECB


def test_sp800_38a_f11_ecb_through_encrypt():
    out = torch.empty(64, dtype=torch.uint8)
    crypt.encrypt(t(SP_PLAIN), out, t(SP_KEY), mode="ecb")
    assert bytes(out.numpy()) == SP_ECB
    back = torch.empty(64, dtype=torch.uint8)
    crypt.decrypt(out, back, t(SP_KEY), mode="ecb")
    assert bytes(back.numpy()) == SP_PLAIN


def test_sp800_38a_f11_ecb_with_a_float_view_of_the_bytes():
    # the same 64 bytes as 16 float32 elements: encrypt works on raw element bytes
    x = t(SP_PLAIN).view(torch.float32).clone()
    out = torch.empty(16, dtype=torch.int32)
    crypt.encrypt(x, out, t(SP_KEY).view(torch.int64).clone(), mode="ecb")
    assert bytes(out.view(torch.uint8).numpy()) == SP_ECB


def test_sp800_38a_f51_ctr_backend():
    enc = Cipher(algorithms.AES(SP_KEY), modes.CTR(SP_CTR_IV)).encryptor()
    assert enc.update(SP_PLAIN) + enc.finalize() == SP_CTR


def test_sp800_38a_f51_ctr_keystream_equals_ecb_of_counter_blocks():
    # CTR = plaintext xor ECB(counter blocks); this is how crypt builds its CTR keystream
    counters = b"".join((int.from_bytes(SP_CTR_IV, "big") + i).to_bytes(16, "big")
                        for i in range(4))
    enc = Cipher(algorithms.AES(SP_KEY), modes.ECB()).encryptor()
    ks = enc.update(counters) + enc.finalize()
    assert bytes(a ^ b for a, b in zip(SP_PLAIN, ks, strict=True)) == SP_CTR
