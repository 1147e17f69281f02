"""torch's Python helpers that take a generator but draw from somewhere else, made fail-closed.

``torch.nn.init.sparse_(w, sparsity, generator=g)`` draws its values from ``g`` but its zero pattern
from ``torch.randperm`` without the generator (torch's global Mersenne Twister): for an ember
generator it gets ember's implementation of the same algorithm, every draw from ``g``.

A ``DataLoader`` over an ``IterDataPipe`` seeds the datapipes' own Mersenne Twisters from one draw
of its generator (``_share_dist_seed``): with an ember generator and a random datapipe (a
``shuffle()``, a ``sample()``...) in the graph, iterating it raises instead of shuffling with a
non-secure generator.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch

from . import patch
from .generator import Generator, for_torch


def sparse_(tensor: torch.Tensor, sparsity: float, std: float = 0.01,
            generator: Any = None) -> torch.Tensor:
    """torch.nn.init.sparse_, with the zero pattern drawn from ``generator`` too."""
    if not isinstance(generator, Generator):
        return _TORCH_SPARSE(tensor, sparsity, std, generator=generator)
    if tensor.ndimension() != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    if tensor.is_meta:
        return tensor
    rows, cols = tensor.shape
    num_zeros = math.ceil(sparsity * rows)
    with torch.no_grad():
        tensor.normal_(0, std, generator=for_torch(generator))
        for col in range(cols):
            zero_rows = torch.randperm(rows, generator=for_torch(generator))[:num_zeros]
            tensor[zero_rows, col] = 0
    return tensor


_ORIGINAL_SPARSE = torch.nn.init.sparse_
# a copy of torch's sparse_ with its own code: install() gives the original function new code
_TORCH_SPARSE = types.FunctionType(_ORIGINAL_SPARSE.__code__, _ORIGINAL_SPARSE.__globals__,
                                   _ORIGINAL_SPARSE.__name__, _ORIGINAL_SPARSE.__defaults__,
                                   _ORIGINAL_SPARSE.__closure__)
_TORCH_SPARSE.__kwdefaults__ = _ORIGINAL_SPARSE.__kwdefaults__


def _routed_sparse(tensor, sparsity, std=0.01, generator=None):
    # the code torch's own sparse_ function runs once ember is installed (it keeps torch's
    # globals and defaults, so it imports what it calls): references to it taken before ember was
    # imported (`from torch.nn.init import sparse_`, the deprecated `sparse` alias), and
    # torch.compile inlining it, reach ember's sparse_
    from ember.csprng.python_paths import sparse_ as ember_sparse_

    return ember_sparse_(tensor, sparsity, std, generator)


def _has_random_datapipe(dataset: Any) -> bool:
    from torch.utils.data import graph, graph_settings

    pipes = graph_settings.get_all_graph_pipes(graph.traverse_dps(dataset))
    is_random = patch.get("torch.utils.data.graph_settings._is_random_datapipe")
    return any(is_random(p) for p in pipes)


def _refuse_datapipe_seeding(original_init: Any) -> Any:
    def __init__(self: Any, loader: Any) -> None:
        if isinstance(loader.generator, Generator):
            from torch.utils.data import IterDataPipe

            if isinstance(loader.dataset, IterDataPipe) and _has_random_datapipe(loader.dataset):
                raise TypeError(
                    "DataLoader(datapipe, generator=<ember.csprng generator>): torch seeds the "
                    "datapipe's shuffle/sampling with a Mersenne Twister (a non-secure generator) "
                    "from one draw of the generator; use a map-style dataset with "
                    "shuffle=True/RandomSampler, whose order ember draws itself")
        original_init(self, loader)

    return __init__


def _check_same_parameters(torch_code: types.CodeType, code: types.CodeType) -> None:
    def parameters(c: types.CodeType) -> tuple:
        n = c.co_argcount + c.co_kwonlyargcount
        return c.co_varnames[:n], c.co_argcount, c.co_posonlyargcount, c.co_flags & 0x0C
    if parameters(torch_code) != parameters(code) or torch_code.co_freevars:
        raise patch.TorchIncompatible(
            f"ember.csprng does not support torch {torch.__version__}: torch.nn.init.sparse_ takes "
            f"{torch_code.co_varnames[:torch_code.co_argcount]}, ember expects "
            f"{code.co_varnames[:code.co_argcount]}")


def install(originals: dict) -> None:
    """Replace the helpers; ``originals`` records (owner, name) -> original for uninstall."""
    init = torch.nn.init
    # torch's function object itself gets code that calls ember's sparse_, so every reference to
    # it (taken before ember was imported too, or inlined by torch.compile) draws from ember
    _check_same_parameters(_ORIGINAL_SPARSE.__code__, _routed_sparse.__code__)
    originals[(_ORIGINAL_SPARSE, "__code__")] = _ORIGINAL_SPARSE.__code__
    _ORIGINAL_SPARSE.__code__ = _routed_sparse.__code__
    originals[(init, "sparse_")] = init.sparse_
    init.sparse_ = sparse_
    cls = patch.get("torch.utils.data.dataloader._BaseDataLoaderIter")
    originals[(cls, "__init__")] = cls.__init__
    cls.__init__ = _refuse_datapipe_seeding(cls.__init__)
