"""encrypt_gcm/decrypt_gcm authenticate the plaintext's dtype and shape: relabelling is refused."""

import dataclasses

import pytest
import torch

from ember.csprng import crypt

KEY = bytes(range(16))


@pytest.mark.parametrize("change", [{"dtype": torch.int32}, {"dtype": torch.uint8, "shape": (24,)},
                                    {"shape": (3, 2)}, {"shape": (6,)}, {"shape": (2, 3, 1)}])
def test_relabelled_ciphertext_is_refused(change):
    x = torch.randn(2, 3)
    sealed = crypt.encrypt_gcm(x, KEY)
    relabelled = dataclasses.replace(sealed, **change)
    with pytest.raises(ValueError, match="authentication failed"):
        crypt.decrypt_gcm(relabelled, KEY)
    ct, nonce, tag = sealed
    with pytest.raises(ValueError, match="authentication failed"):
        crypt.decrypt_gcm(ct, KEY, nonce, tag, dtype=relabelled.dtype, shape=relabelled.shape)
    back = crypt.decrypt_gcm(sealed, KEY)
    assert back.dtype == x.dtype and back.shape == x.shape and torch.equal(back, x)


def test_user_associated_data_cannot_be_moved_into_the_metadata():
    # length prefixes keep (metadata, associated_data) pairs apart
    a = crypt.gcm_associated_data(torch.float32, (2,), b"x")
    b = crypt.gcm_associated_data(torch.float32, (2,), b"")
    assert a != b and not a.startswith(b)
    assert crypt.gcm_associated_data(torch.float32, (2, 3)) != \
        crypt.gcm_associated_data(torch.float32, (6,))


def test_scalars_and_empty_tensors_round_trip():
    for x in (torch.tensor(3.5), torch.empty(0, 4)):
        back = crypt.decrypt_gcm(crypt.encrypt_gcm(x, KEY), KEY)
        assert back.shape == x.shape and back.dtype == x.dtype and torch.equal(back, x)
