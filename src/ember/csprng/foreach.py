"""Draws into many tensors at once, with exactly the values of one call per tensor.

``normal_foreach_(tensors, std, generator=g)`` fills ``tensors`` in order as
``for t in tensors: t.normal_(mean, std, generator=g)`` would (same values, same stream position)
with less work per tensor: on CPU one keystream pass for all small tensors and no per-call routing;
on CUDA (the NVRTC path) one kernel launch for all tensors and no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .distributions import NativeSampler
from .generator import Generator


def normal_foreach_(tensors: Sequence[torch.Tensor], std: float = 1.0, *, mean: float = 0.0,
                    generator: Generator) -> list[torch.Tensor]:
    """Fill every tensor of ``tensors`` with normal values (``mean``, ``std``), in order.

    Gives exactly the values and the final generator position of
    ``[t.normal_(mean, std, generator=generator) for t in tensors]``. Returns the tensors.
    """
    from .torch_adapter import InvalidArgument, UnsupportedDtype, _bump_version, _refuse_capture, fill_

    if not isinstance(generator, Generator):
        raise TypeError(f"normal_foreach_: generator must be an ember.csprng Generator, got "
                        f"{type(generator).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"normal_foreach_: tensors[{i}] is a {type(t).__name__}, expected a tensor")
        if not (t.is_floating_point() or t.is_complex()):
            raise UnsupportedDtype(f"normal_foreach_: tensors[{i}] has dtype {t.dtype}, expected a "
                                   "floating-point dtype")
        if t.requires_grad and torch.is_grad_enabled() and t.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place "
                               f"operation (normal_foreach_: tensors[{i}])")
    mean, std = float(mean), float(std)
    if not std >= 0.0:
        raise InvalidArgument(f"normal_foreach_ expects std >= 0.0, but found std {std}")
    sampler = generator.sampler()
    cpu = [t.is_cpu and t.layout == torch.strided and t.is_contiguous() and not t.is_complex()
           and not t.is_conj() and not t.is_neg() for t in tensors]
    if type(sampler) is NativeSampler and all(cpu):
        sampler.normal_foreach_(tensors, mean, std)
        for t in tensors:
            if t.numel():
                _bump_version(t)
        return tensors
    if tensors and type(sampler) is NativeSampler and _one_launch(sampler, tensors, None):
        from . import cuda_fast

        cuda_fast.normal_multi_(sampler, tensors, mean, std)
        return tensors
    # one call per tensor: a CUDA tensor among them is refused during graph capture before the
    # first tensor is drawn, not after the CPU tensors before it have consumed stream
    _refuse_capture("normal_foreach_", *tensors)
    for t in tensors:
        fill_(t, generator, "normal_", mean, std)
    return tensors


def _one_launch(sampler: NativeSampler, tensors: list[torch.Tensor], kernel: str | None) -> bool:
    """Whether the NVRTC path can fill all ``tensors`` in one launch (it then is ready to)."""
    from . import cuda_backend, cuda_fast

    dev = tensors[0].device
    if dev.type != "cuda" or cuda_backend.fast_path() != "nvrtc":
        return False
    if sampler.stream.cipher_name not in ("aes128", "chacha20"):
        return False
    for t in tensors:
        if (t.device != dev or t.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                or not t.is_contiguous() or t.layout != torch.strided):
            return False
    cuda_backend.refuse_capture("normal_foreach_" if kernel is None else "secure_noise_foreach_")
    names = (kernel or f"ember_{'aes' if sampler.stream.cipher_name == 'aes128' else 'chacha'}_normal_multi",)
    try:  # compiled and loaded before anything is reserved
        cuda_fast.launcher().functions(dev.index or 0, names)
    except Exception as exc:  # no cuda-bindings, no NVRTC for this GPU, no driver
        cuda_backend.nvrtc_broken(exc, stacklevel=3)  # warns once (or raises when forced)
        return False
    return True


def secure_noise_foreach_(tensors: Sequence[torch.Tensor], std: float, *,
                          generator: Generator) -> list[torch.Tensor]:
    """Fill every float32 tensor with Opacus's secure-mode Gaussian noise, in order.

    For each tensor ``t``: one throw-away ``normal(0, std, (1, 1))`` draw, then
    ``((((0 + z1) + z2) + z3) + z4) / 2`` of four ``normal(0, std, t.shape)`` float32 draws (the
    defence of Holohan et al., arXiv 2107.10138, as Opacus's ``_generate_noise(secure_mode=True)``
    does it): exactly Opacus's values and generator position. On CUDA with the NVRTC path and an
    AES-128 generator it is one kernel launch for all tensors; elsewhere one ``normal_foreach_``.
    """
    if not isinstance(generator, Generator):
        raise TypeError(f"secure_noise_foreach_: generator must be an ember.csprng Generator, got "
                        f"{type(generator).__name__}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            raise TypeError(f"secure_noise_foreach_: tensors[{i}] must be a float32 tensor")
    std = float(std)
    if not std > 0.0:
        raise ValueError(f"secure_noise_foreach_: expected std > 0, got {std}")
    from .torch_adapter import _refuse_capture

    _refuse_capture("secure_noise_foreach_", *tensors)  # before anything is allocated or drawn
    sampler = generator.sampler()
    if (tensors and type(sampler) is NativeSampler and sampler.stream.cipher_name == "aes128"
            and _one_launch(sampler, tensors, "ember_aes_secure_noise")):
        from . import cuda_fast

        cuda_fast.secure_noise_(sampler, tensors, std)
        return tensors
    draws: list[torch.Tensor] = []
    for t in tensors:
        draws.append(torch.empty((1, 1), device=t.device))
        draws.extend(torch.empty(t.shape, device=t.device) for _ in range(4))
    normal_foreach_(draws, std, generator=generator)
    # ((((0 + z1) + z2) + z3) + z4) / 2 for every tensor, one foreach operation per step
    totals = [torch.zeros(t.shape, device=t.device) for t in tensors]
    for k in range(1, 5):
        torch._foreach_add_(totals, draws[k::5])
    torch._foreach_div_(totals, 2.0)
    torch._foreach_copy_(tensors, totals)
    return tensors
