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
from typing import Any

import torch

from . import patch
from .generator import Generator, for_torch


def sparse_(tensor: torch.Tensor, sparsity: float, std: float = 0.01,
            generator: Any = None) -> torch.Tensor:
    """torch.nn.init.sparse_, with the zero pattern drawn from ``generator`` too."""
    if not isinstance(generator, Generator):
        return _ORIGINAL_SPARSE(tensor, sparsity, std, generator=generator)
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


def install(originals: dict) -> None:
    """Replace the helpers; ``originals`` records (owner, name) -> original for uninstall."""
    init = torch.nn.init
    from .torch_adapter import _EARLY_BOUND_CODES

    # references to torch's sparse_ taken before this (`from torch.nn.init import sparse_`, and
    # the deprecated `sparse` made from it) keep calling it: its normal_ call refuses ember
    code = _ORIGINAL_SPARSE.__code__
    _EARLY_BOUND_CODES[id(code)] = code
    originals[(init, "sparse_")] = init.sparse_
    init.sparse_ = sparse_
    if hasattr(init, "sparse"):  # the deprecated alias calls the function it was made from
        originals[(init, "sparse")] = init.sparse
        init.sparse = patch.get("torch.nn.init._make_deprecate")(sparse_)
    cls = patch.get("torch.utils.data.dataloader._BaseDataLoaderIter")
    originals[(cls, "__init__")] = cls.__init__
    cls.__init__ = _refuse_datapipe_seeding(cls.__init__)
