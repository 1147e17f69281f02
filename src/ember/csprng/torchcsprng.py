"""torchcsprng's Python API on ember's generators, for code that does ``import torchcsprng``.

torchcsprng (the PyTorch extension this subsystem succeeds) stopped at torch 1.8, so libraries that
import it, Opacus's ``PrivacyEngine(secure_mode=True)`` first among them, cannot turn their secure
mode on with today's torch. This module offers the same functions backed by ember:

>>> import ember.csprng
>>> ember.csprng.provide_torchcsprng()      # now ``import torchcsprng`` gives this module
>>> import torchcsprng
>>> g = torchcsprng.create_random_device_generator("/dev/urandom")

Covered: ``create_random_device_generator(token=None)``, ``create_mt19937_generator(seed=None)``,
``encrypt``/``decrypt`` (same semantics), ``supports_cuda()``, ``__version__``, ``git_version`` and
the ``torchcsprng.version`` module. torchcsprng's
generators were ``torch.Generator`` objects; ember's are not (see docs/csprng.md), which matters only
to code that checks ``isinstance(g, torch.Generator)``.
"""

from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType

import torch

from .. import __version__ as _ember_version
from .generator import Generator, supports_cuda
from .generator import create_mt19937_generator as _create_mt19937_generator
from .generator import create_random_device_generator as _create_random_device_generator

__all__ = [
    "TorchcsprngConflict",
    "__version__",
    "create_mt19937_generator",
    "create_random_device_generator",
    "decrypt",
    "encrypt",
    "git_version",
    "provide_torchcsprng",
    "supports_cuda",
    "version",
]

#: The torchcsprng release whose API this module follows, with ember's marker.
__version__ = "0.2.1+ember"
#: torchcsprng's build revision; here the ember release that provides the module.
git_version = f"ember-{_ember_version}"

# std::random_device tokens (libstdc++, libc++, MSVC) that name an operating-system or hardware
# source of entropy. ember reads the operating system's CSPRNG (os.urandom) for all of them.
_SECURE_TOKENS = frozenset({
    "default", "/dev/urandom", "/dev/random", "rdrand", "rdrnd", "rdseed", "rand_s",
    "getentropy", "arc4random", "hw", "hardware",
})


class TorchcsprngConflict(ImportError):
    """A real torchcsprng is installed or already imported, so ember will not stand in for it."""


def create_random_device_generator(token: str | None = None) -> Generator:
    """A cryptographically secure generator keyed from the operating system (as torchcsprng's).

    ``token`` names a ``std::random_device`` source as in torchcsprng (``"/dev/urandom"``,
    ``"default"``, ``"rdrand"``, ...); ember reads ``os.urandom`` for every secure source. The tokens
    that make libstdc++'s random device a seeded Mersenne Twister (``"mt19937"`` or a number) are
    refused: use :func:`create_mt19937_generator` for a reproducible, non-secure stream.
    """
    if token is not None:
        if not isinstance(token, str):
            raise TypeError(f"create_random_device_generator: token must be a str or None, "
                            f"got {type(token).__name__}")
        if token == "mt19937" or token.strip().lstrip("+-").isdigit():
            raise ValueError(
                f"create_random_device_generator: token {token!r} selects a seeded Mersenne "
                "Twister in libstdc++, which is not a secure source; use "
                "create_mt19937_generator(seed) for a reproducible stream")
        if token not in _SECURE_TOKENS:
            raise ValueError(
                f"create_random_device_generator: unknown random-device token {token!r}; expected "
                f"None or one of {', '.join(sorted(_SECURE_TOKENS))}")
    return _create_random_device_generator()


def create_mt19937_generator(seed: int | None = None) -> Generator:
    """A reproducible, *not* secure generator with torchcsprng's ``create_mt19937_generator``
    streams (same values for the same seed; layout in shared/specs/torchcsprng-stream.md)."""
    return _create_mt19937_generator(seed)


def encrypt(input: torch.Tensor, output: torch.Tensor, key: torch.Tensor, cipher: str = "aes128",
            mode: str = "ecb") -> torch.Tensor:
    """torchcsprng's ``encrypt``: see :func:`ember.csprng.encrypt` (unauthenticated)."""
    from .crypt import encrypt as _encrypt

    return _encrypt(input, output, key, cipher, mode)


def decrypt(input: torch.Tensor, output: torch.Tensor, key: torch.Tensor, cipher: str = "aes128",
            mode: str = "ecb") -> torch.Tensor:
    """torchcsprng's ``decrypt``: see :func:`ember.csprng.decrypt`."""
    from .crypt import decrypt as _decrypt

    return _decrypt(input, output, key, cipher, mode)


def _this_module() -> ModuleType:
    return sys.modules[__name__]


def _real_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of an installed torchcsprng on sys.path, ignoring this module."""
    return importlib.machinery.PathFinder.find_spec("torchcsprng")


def provide_torchcsprng() -> ModuleType:
    """Make ``import torchcsprng`` resolve to this module; returns it.

    Call it once before the library that imports torchcsprng (for Opacus: before
    ``PrivacyEngine(secure_mode=True)``). Calling it again is harmless. If a real torchcsprng is
    installed (found on ``sys.path``) or another module is already registered as ``torchcsprng``,
    it raises :class:`TorchcsprngConflict` and changes nothing: ember never shadows it. Uninstall
    that package (its builds stop at torch 1.8) to use ember in its place.
    """
    me = _this_module()
    present = sys.modules.get("torchcsprng")
    if present is me:
        return me
    if present is not None:
        raise TorchcsprngConflict(
            f"a module is already imported as 'torchcsprng' ({getattr(present, '__file__', present)!r});"
            " ember.csprng.provide_torchcsprng() will not replace it")
    spec = _real_spec()
    if spec is not None:
        where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        raise TorchcsprngConflict(
            f"a real torchcsprng is installed at {where}; ember.csprng.provide_torchcsprng() will not "
            "shadow it. Uninstall it (pip uninstall torchcsprng; its builds stop at torch 1.8) to "
            "let ember stand in, or use it directly")
    sys.modules["torchcsprng"] = me
    sys.modules["torchcsprng.version"] = version
    return me


def _version_module() -> ModuleType:
    """``torchcsprng.version``, which torchcsprng's package had (``__version__``, ``git_version``)."""
    module = ModuleType("torchcsprng.version")
    module.__version__ = __version__  # type: ignore[attr-defined]
    module.git_version = git_version  # type: ignore[attr-defined]
    return module


#: ``torchcsprng.version``: a package's imported submodule is also its attribute, which
#: ``import torchcsprng.version as v`` and ``from torchcsprng import version`` read
version = _version_module()
