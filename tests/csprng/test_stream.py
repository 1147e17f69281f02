"""Block reservation, keystream layout and key derivation of the counter-based stream."""

import hashlib
import hmac
import threading

import numpy as np
import pytest
from Crypto.Cipher import AES

from ember.csprng.stream import BlockStream, CounterExhausted, derive_key, key_from_seed

KEY = bytes(range(16))


def reference_blocks(key: bytes, counter: int, n: int) -> bytes:
    """Independent reference: AES-ECB (pycryptodome) of the big-endian 128-bit counters."""
    ecb = AES.new(key, AES.MODE_ECB)
    blocks = b"".join(((counter + i) % (1 << 128)).to_bytes(16, "big") for i in range(n))
    return ecb.encrypt(blocks)


@pytest.mark.parametrize("counter", [0, 5, (1 << 32) - 2, (1 << 64) - 3, (1 << 96) - 1, (1 << 128) - 4])
def test_keystream_matches_aes_of_big_endian_counters(counter):
    s = BlockStream(KEY, counter)
    draw = s.draw(4)
    buf = bytearray(64)
    draw.fill(memoryview(buf))
    assert bytes(buf) == reference_blocks(KEY, counter, 4)
    assert s.counter == counter + 4


def test_partial_last_block_discards_the_rest_and_counts_whole_blocks():
    s = BlockStream(KEY, 7)
    draw = s.draw(2)
    buf = bytearray(20)
    draw.fill(memoryview(buf))
    assert bytes(buf) == reference_blocks(KEY, 7, 2)[:20]
    assert s.counter == 9


def test_sequential_draws_reuse_writer_and_stay_correct():
    s = BlockStream(KEY, 0)
    out = bytearray()
    for n in (1, 3, 2, 5):
        buf = bytearray(16 * n)
        s.draw(n).fill(memoryview(buf))
        out += buf
    assert bytes(out) == reference_blocks(KEY, 0, 11)


def test_position_is_the_sum_of_sizes_drawn():
    s = BlockStream(KEY, 100)
    sizes = [3, 1, 17, 4]
    for n in sizes:
        s.reserve(n)
    assert s.counter == 100 + sum(sizes)


def test_counter_exhaustion_raises_instead_of_wrapping():
    s = BlockStream(KEY, (1 << 128) - 2)
    s.reserve(2)
    with pytest.raises(CounterExhausted, match="2\\*\\*128"):
        s.reserve(1)
    assert s.counter == 1 << 128


def test_concurrent_reservations_never_overlap():
    s = BlockStream(KEY, 0)
    got: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine = []
        for _ in range(300):
            n = int(rng.integers(1, 50))
            mine.append((s.reserve(n), n))
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got.sort()
    position = 0
    for start, n in got:
        assert start == position  # contiguous and disjoint
        position += n
    assert s.counter == position


def test_derived_keys_follow_the_documented_hmac():
    msg = b"ember.csprng/v1/fold_in\x00" + (7).to_bytes(16, "little")
    assert derive_key(KEY, "fold_in", 7) == hmac.new(KEY, msg, hashlib.sha256).digest()[:16]
    assert derive_key(KEY, "fold_in", 7) != derive_key(KEY, "spawn", 7)
    assert derive_key(KEY, "fold_in", 7) != derive_key(KEY, "fold_in", 8)


def test_seed_kdf_is_documented_sha256():
    want = hashlib.sha256(b"ember.csprng/v1/seed\x00" + (42).to_bytes(16, "little")).digest()[:16]
    assert key_from_seed(42) == want


@pytest.mark.parametrize("bad", [-1, 1 << 128])
def test_seed_out_of_range_is_rejected(bad):
    with pytest.raises(ValueError, match="seed must be in"):
        key_from_seed(bad)


def test_wrong_key_length_names_the_sizes():
    with pytest.raises(ValueError, match="expected a 16-byte key, got 12 bytes"):
        BlockStream(bytes(12))
