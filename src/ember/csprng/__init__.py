"""ember.csprng: cryptographically secure random numbers for PyTorch.

``torch.randn(3, generator=g)`` with ``g = ember.csprng.create_random_device_generator()`` draws from
AES-128 in counter mode. See docs/csprng.md for the API and docs/csprng-stream.md for the exact
stream layout.
"""

from . import chacha as _chacha  # noqa: F401 - registers the "chacha20" cipher
from . import cuda_backend as _cuda_backend  # noqa: F401 - registers the "cuda" backend
from . import torch_adapter as _torch_adapter
from .foreach import normal_foreach_
from .generator import (
    Generator,
    InheritedStateUsed,
    create_generator,
    create_mt19937_generator,
    create_random_device_generator,
    is_generator,
    supports_cuda,
)
from .stream import CounterExhausted
from .torchcsprng import provide_torchcsprng

_torch_adapter.install()

__all__ = [
    "CounterExhausted",
    "Generator",
    "InheritedStateUsed",
    "create_generator",
    "create_mt19937_generator",
    "create_random_device_generator",
    "decrypt",
    "encrypt",
    "is_generator",
    "normal_foreach_",
    "provide_torchcsprng",
    "supports_cuda",
]


def __getattr__(name: str):
    if name in ("encrypt", "decrypt", "encrypt_gcm", "decrypt_gcm"):
        from . import crypt

        return getattr(crypt, name)
    raise AttributeError(f"module 'ember.csprng' has no attribute {name!r}")
