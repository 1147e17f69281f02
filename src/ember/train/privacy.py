"""Differentially private training (DP-SGD) for :func:`ember.train.fit`, on Opacus's pieces.

``fit(..., privacy=PrivacyConfig(epsilon=3.0, delta=1e-5, max_grad_norm=1.0))`` trains with
DP-SGD: per-example gradients (Opacus's ``GradSampleModule``) clipped to ``max_grad_norm``,
Opacus's secure-mode Gaussian noise, and Poisson-sampled logical batches, both drawn from an
ember.csprng generator keyed from the OS; the budget is tracked by Opacus's accountant, stepped
once per logical batch. The sample rate is ``1 / len(train_loader)`` and an epoch is exactly
``len(train_loader)`` logical steps (Opacus's own loader loses a step for many sizes). Logical
batches can be split into physical ones (``max_physical_batch_size``, Opacus's
``BatchMemoryManager`` semantics) and several processes train together (Opacus's DPDDP and
distributed Poisson sampling: each rank samples its share of the examples with its own ember
stream, the clipped sums are added over ranks, and rank 0 adds the noise once per step).
Opacus is imported only when used (``pip install ember[dp]``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, cast

import torch
from torch import nn

from ember.train.errors import ConfigError
from ember.train.privacy_config import ACCOUNTANTS, PrivacyConfig

__all__ = ["ACCOUNTANTS", "NOT_COVERED_BY_DP", "EpsilonTooLowError", "PrivacyConfig",
           "PrivateTraining", "add_secure_noise", "check_combination", "check_loader",
           "check_model", "fuse_secure_noise", "make_private", "secure_noise", "strip_opacus"]


# record fields computed from the training data without noise: epsilon does not cover them
NOT_COVERED_BY_DP = ("train_loss", "loss", "nonempty_batches", "batches", "dataset_size",
                     "expected_batch_size")

# what Opacus attaches to modules (GradSampleModule and its functorch path) and to parameters
_OPACUS_MODULE_ATTRS = ("autograd_grad_sample_hooks", "activations", "max_batch_len",
                        "ft_compute_sample_grad", "norm_sample", "_forward_counter")
_OPACUS_PARAM_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample",
                       "summed_grad", "ddp_hooks")

# PyTorch warns on every private fit whose first layer's input needs no gradient (Opacus's full
# backward hooks then fire on the outputs only, which is all they need)
_FULL_BACKWARD_HOOK_WARNING = re.escape(
    "Full backward hook is firing when gradients are computed with respect to module outputs "
    "since no inputs require gradients")


class EpsilonTooLowError(ConfigError):
    """The target epsilon cannot be reached with any noise multiplier Opacus searches
    (``steps`` logical steps at ``sample_rate``)."""

    def __init__(self, message: str, *, steps: int, sample_rate: float) -> None:
        super().__init__(message)
        self.steps, self.sample_rate = steps, sample_rate


def _opacus():
    try:
        import opacus
    except ImportError as e:  # pragma: no cover - opacus is in the dev extra
        raise ConfigError("privacy= needs Opacus: pip install 'ember[dp]'") from e
    return opacus


def check_model(model: nn.Module, *, replace_batchnorm: bool = False) -> nn.Module:
    """Make ``model`` acceptable for DP-SGD or raise :class:`ConfigError` naming the layer.

    Every BatchNorm is refused, trainable or not: in train mode its batch statistics mix the
    examples of a batch (Opacus's validator only looks at layers with trainable parameters).
    With ``replace_batchnorm`` each is replaced in place by the GroupNorm Opacus's
    ``ModuleValidator.fix`` chooses (``gcd(32, C)`` groups), reusing its weight and bias; a layer
    registered under several names becomes one GroupNorm under all of them. Any other norm layer
    keeping running statistics (``InstanceNorm*(track_running_stats=True)``) is refused: they are
    un-noised statistics of the training data. Uninitialised lazy layers are refused. The model
    is put in train mode.
    """
    _opacus()
    from opacus.validators import ModuleValidator

    def where(name: str, m: Any) -> str:
        return f"{name or 'model'!r} ({type(m).__name__})"

    modules = list(model.named_modules(remove_duplicate=False))
    for name, m in modules:
        if isinstance(m, nn.modules.lazy.LazyModuleMixin) \
                and m.has_uninitialized_params():  # type: ignore[misc]  # torch's own annotation
            raise ConfigError(f"the model cannot be trained with DP-SGD: layer {where(name, m)} "
                              f"is uninitialised (lazy): call the model once on an example "
                              f"batch before fit")
        if isinstance(m, nn.modules.batchnorm._NormBase) \
                and not isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ConfigError(f"the model cannot be trained with DP-SGD: layer {where(name, m)} "
                              f"has track_running_stats=True: its running statistics are "
                              f"computed from the training data without noise and would be "
                              f"published with the model; build it with "
                              f"track_running_stats=False")
    batchnorms = [(name, m) for name, m in modules
                  if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batchnorms and not replace_batchnorm:
        name, m = batchnorms[0]
        raise ConfigError(f"the model cannot be trained with DP-SGD: BatchNorm layer "
                          f"{where(name, m)} mixes the examples of a batch, trainable or not (set "
                          f"PrivacyConfig(replace_batchnorm=True) to use GroupNorm instead)")
    replaced: dict[int, nn.GroupNorm] = {}
    for name, m in batchnorms:
        if not name:
            raise ConfigError("the model is itself a BatchNorm layer: nothing to train privately")
        if id(m) not in replaced:
            fixed = nn.GroupNorm(math.gcd(32, m.num_features), m.num_features, eps=m.eps,
                                 affine=m.affine)
            if m.affine:
                fixed.weight, fixed.bias = m.weight, m.bias
            replaced[id(m)] = fixed
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], replaced[id(m)])
    left = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left:
        raise ConfigError(f"the model cannot be trained with DP-SGD: BatchNorm layer "
                          f"{where(*left[0])} could not be replaced")
    model.train()
    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(f"the model cannot be trained with DP-SGD: {errors[0]}")
    return model


def add_secure_noise(tensors: Sequence[torch.Tensor], std: float,
                     generator: Any) -> list[torch.Tensor]:
    """``tensors`` plus Opacus's secure-mode Gaussian noise of std ``std`` (one draw per tensor,
    in order, from ``generator``): the one place DP-SGD's noise is drawn. On an ember generator
    the draws for all tensors are made together (:func:`secure_noise`), with exactly the values of
    Opacus's per-tensor ``_generate_noise``."""
    import ember.csprng as csprng

    if csprng.is_generator(generator):
        return [t + z for t, z in zip(tensors, secure_noise(std, list(tensors), generator),
                                      strict=True)]
    from opacus.optimizers.optimizer import _generate_noise

    return [t + _generate_noise(std, t, generator=generator, secure_mode=True) for t in tensors]


def check_loader(loader: Any, world: Any) -> None:
    """Refuse a training loader Poisson sampling cannot stand in for: not a DataLoader over a
    map-style dataset with a ``batch_size``, or one whose epoch does not read every example of
    its dataset once (Poisson sampling draws from the whole dataset, so it would train on the
    examples left out)."""
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

    if not isinstance(loader, torch.utils.data.DataLoader) or \
            isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise ConfigError("privacy needs a torch.utils.data.DataLoader over a map-style dataset: "
                          f"Poisson sampling picks examples by index (got {type(loader).__name__})")
    sampler: Any = loader.sampler
    n = len(cast(Sized, loader.dataset))
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError("privacy needs a DataLoader with a batch_size (not batch_sampler= or "
                          "batch_size=None): its batch count sets the sample rate")

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"privacy: the loader's sampler ({type(sampler).__name__}) {why}, but "
                           f"Poisson sampling draws from the whole dataset ({n} examples) and "
                           f"would train on the ones it leaves out; pass a DataLoader over "
                           f"exactly the training examples (e.g. torch.utils.data.Subset("
                           f"dataset, train_idx)) with shuffle=True or False")

    # these samplers read indices range(len(their own data source)), whatever it holds: the
    # source must be as long as the loader's dataset
    if isinstance(sampler, DistributedSampler):
        source = len(cast(Sized, sampler.dataset))
        if source != n:
            raise refuse(f"reads indices 0..{source - 1} only")
        if sampler.drop_last and n % sampler.num_replicas:
            raise refuse("has drop_last=True and drops examples")
        if sampler.num_replicas != world.size or sampler.rank != world.rank:
            raise ConfigError(f"privacy: the loader's DistributedSampler has num_replicas="
                              f"{sampler.num_replicas}, rank={sampler.rank}; this process is rank "
                              f"{world.rank} of {world.size}")
        return
    if type(sampler) in (SequentialSampler, RandomSampler) and len(sampler.data_source) != n:
        raise refuse(f"reads indices 0..{len(sampler.data_source) - 1} only")
    if type(sampler) is SequentialSampler or (
            type(sampler) is RandomSampler and not sampler.replacement
            and sampler.num_samples == n):
        return
    raise refuse("does not read every example of the dataset exactly once per epoch")


class _PoissonBatches:
    """Batch sampler of DP-SGD: every logical step draws each example of this rank's share with
    probability ``sample_rate`` (empty batches included), split into physical batches of at most
    ``max_physical``. ``closes`` tells, in order, which physical batch ends its logical one;
    ``stop(k)`` is asked before drawing logical step k + 1 (the budget stop; ``drawn`` counts from
    the run's start, so a loader that prefetches cannot make it late)."""

    def __init__(self, share: torch.Tensor, sample_rate: float, steps: int,
                 generator: Any, max_physical: int | None,
                 stop: Callable[[int], bool]) -> None:
        self.share, self.sample_rate, self.steps = share, sample_rate, steps
        self.generator, self.max_physical, self.stop = generator, max_physical, stop
        self.closes: collections.deque[bool] = collections.deque()
        self.stopped = False
        self.drawn = 0

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            if self.stop(self.drawn):
                self.stopped = True
                return
            self.drawn += 1
            mask = torch.rand(len(self.share), generator=self.generator) < self.sample_rate
            chosen = self.share[mask].tolist()
            size = self.max_physical or max(len(chosen), 1)
            chunks = [chosen[i:i + size] for i in range(0, len(chosen), size)] or [[]]
            for i, chunk in enumerate(chunks):
                self.closes.append(i == len(chunks) - 1)
                yield chunk

    def __len__(self) -> int:
        return self.steps


class _CollateWithEmpty:
    """The loader's collate function; an empty Poisson batch becomes zero-length tensors shaped
    like one example's (only the shapes of example 0 are used, never its values)."""

    def __init__(self, collate: Callable, dataset: Any) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, items: list) -> Any:
        if items:
            return self.collate(items)
        return _empty_like(self.collate([self.dataset[0]]))


def _empty_like(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    raise ConfigError(f"privacy: cannot make an empty batch of {type(batch).__name__} (Poisson "
                      f"sampling gives empty batches; collate to tensors)")


def _dp_optimizer(optimizer: torch.optim.Optimizer, sigma: float, max_grad_norm: float,
                  expected_batch_size: float, generator: Any, world: Any) -> Any:
    """Opacus's DPOptimizer drawing its noise through :func:`add_secure_noise`; under several
    processes the clipped sums are added over ranks and only rank 0 adds noise
    (``DistributedDPOptimizer``'s semantics)."""
    from opacus.optimizers.optimizer import DPOptimizer, _check_processed_flag, _mark_as_processed

    class EmberDPOptimizer(DPOptimizer):
        def add_noise(self) -> None:
            params = self.params
            for p in params:
                _check_processed_flag(p.summed_grad)
            summed = [p.summed_grad for p in params]
            if world.rank == 0:
                summed = add_secure_noise(summed, self.noise_multiplier * self.max_grad_norm,
                                          self.generator)
            for p, g in zip(params, summed, strict=True):
                p.grad = g.view_as(p)
                _mark_as_processed(p.summed_grad)

        def step(self, closure: Callable | None = None) -> Any:
            if closure is not None:
                with torch.enable_grad():
                    closure()
            if not self.pre_step():
                return None
            if world.distributed:
                # each rank holds (its clipped sum [+ noise on rank 0]) / the global expected
                # batch: the sum over ranks is the one-process update
                for p in self.params:
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
            return self.original_optimizer.step()

    return EmberDPOptimizer(optimizer, noise_multiplier=sigma, max_grad_norm=max_grad_norm,
                            expected_batch_size=expected_batch_size, loss_reduction="mean",
                            generator=generator, secure_mode=True)


def strip_opacus(model: nn.Module) -> nn.Module:
    """Remove what Opacus attached to ``model`` (in place): per-example gradient hooks, the
    modules' ``activations`` (after an error between a forward and its backward they hold raw
    training inputs), ``max_batch_len`` and functorch attributes, and the ``grad_sample`` /
    ``summed_grad`` / counter attributes of its parameters. Only plain instance attributes of
    these names are removed, never parameters, buffers or submodules."""
    for m in model.modules():
        hooks = m.__dict__.get("autograd_grad_sample_hooks")
        for handle in hooks or ():
            handle.remove()
        for attr in _OPACUS_MODULE_ATTRS:
            if attr in m.__dict__:
                delattr(m, attr)
    for p in model.parameters():
        for attr in _OPACUS_PARAM_ATTRS:
            if hasattr(p, attr):
                delattr(p, attr)
    return model


def _same_buffer(b: torch.Tensor | None, saved: torch.Tensor) -> bool:
    return b is not None and b.shape == saved.shape and b.dtype == saved.dtype


class PrivateTraining:
    """One private run: ``module`` (per-example gradients), ``optimizer`` (clip + noise),
    ``loader`` (Poisson logical batches, maybe split into physical ones), the ember
    ``generator`` of this rank and Opacus's ``accountant``, stepped once per logical step."""

    def __init__(self, model: nn.Module, module: Any, optimizer: Any, loader: Any,
                 batches: _PoissonBatches, generator: Any, accountant: Any,
                 config: PrivacyConfig, noise_multiplier: float, sample_rate: float,
                 steps_per_epoch: int, dataset_size: int, world: Any) -> None:
        self.model, self.module, self.optimizer, self.loader = model, module, optimizer, loader
        self.batches, self.generator, self.accountant = batches, generator, accountant
        self.config, self.noise_multiplier, self.sample_rate = config, noise_multiplier, sample_rate
        self.steps_per_epoch, self.dataset_size, self.world = steps_per_epoch, dataset_size, world
        self.private = config.noise_seed is None
        self.stopped = False
        self._buffers: dict[str, torch.Tensor] = {}
        batches.stop = self._next_step_exceeds

    def watch_buffers(self) -> None:
        """Remember the model's floating-point buffers: a training step must not change them."""
        self._buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()
                         if b.is_floating_point() or b.is_complex()}

    def check_buffers(self) -> None:
        """Raise :class:`ConfigError` naming the first buffer a training step changed (a
        statistic of the training data without noise), after putting every buffer back."""
        now = dict(self.model.named_buffers())
        for name, saved in self._buffers.items():
            b = now.get(name)
            if b is not None and _same_buffer(b, saved) and torch.allclose(
                    b.detach(), saved.to(b.device), rtol=0, atol=0, equal_nan=True):
                continue
            self._restore_buffers()
            owner, _, attr = name.rpartition(".")
            layer = self.model.get_submodule(owner)
            raise ConfigError(f"privacy: buffer {attr!r} of layer {owner or 'model'!r} "
                              f"({type(layer).__name__}) changed during a training step: it is "
                              f"computed from the training data without noise and would be "
                              f"published with the model; DP-SGD cannot train such a model "
                              f"(buffers restored)")

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for name, saved in self._buffers.items():
                owner, _, attr = name.rpartition(".")
                layer = self.model.get_submodule(owner)
                current = layer._buffers.get(attr)
                if current is not None and _same_buffer(current, saved):
                    current.copy_(saved)
                else:
                    layer._buffers[attr] = saved.clone()

    @staticmethod
    def quiet_hooks() -> contextlib.AbstractContextManager:
        """A context hiding PyTorch's warning about full backward hooks on modules whose inputs
        need no gradient (Opacus's hooks only need the outputs'), and nothing else."""
        @contextlib.contextmanager
        def quiet() -> Iterator[None]:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_FULL_BACKWARD_HOOK_WARNING,
                                        category=UserWarning)
                yield
        return quiet()

    @property
    def steps(self) -> int:
        """Logical steps the accountant has counted."""
        return sum(int(n) for _, _, n in self.accountant.history)

    def closes_step(self) -> bool:
        """Whether the physical batch just read ends its logical batch."""
        return self.batches.closes.popleft()

    def accumulate(self) -> None:
        """Clip and add up the per-example gradients of a physical batch that does not end its
        logical one (no noise, no step, nothing counted)."""
        self.optimizer.signal_skip_step(do_skip=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def epoch_done(self) -> None:
        """Note a budget stop of the epoch just finished."""
        self.stopped = self.stopped or self.batches.stopped

    def _next_step_exceeds(self, taken: int) -> bool:
        if self.stopped:
            return True
        if self.config.max_epsilon is None:
            return False
        probe = type(self.accountant)()
        probe.history = [(self.noise_multiplier, self.sample_rate, taken + 1)]
        return float(probe.get_epsilon(self.config.delta)) > self.config.max_epsilon

    def epsilon(self) -> float:
        """The budget spent so far at the configured delta (Opacus's accountant)."""
        if not self.accountant.history:
            return 0.0
        return float(self.accountant.get_epsilon(self.config.delta))

    def report(self) -> dict[str, Any]:
        """What a reader of the result needs: q, sigma, delta, steps, accountant, epsilon."""
        return {"private": self.private, "accountant": self.config.accountant,
                "sample_rate": self.sample_rate, "noise_multiplier": self.noise_multiplier,
                "delta": self.config.delta, "max_grad_norm": self.config.max_grad_norm,
                "steps": self.steps, "epsilon": self.epsilon(),
                "max_epsilon": self.config.max_epsilon, "stopped_early": self.stopped,
                "dataset_size": self.dataset_size,
                "expected_batch_size": self.dataset_size * self.sample_rate,
                "max_physical_batch_size": self.config.max_physical_batch_size,
                "world_size": self.world.size, "not_covered_by_dp": list(NOT_COVERED_BY_DP)}

    def epoch_record(self) -> dict[str, Any]:
        """The privacy fields of an epoch record."""
        return {"epsilon": self.epsilon(), "dp_steps": self.steps,
                "dp_sample_rate": self.sample_rate, "dp_noise_multiplier": self.noise_multiplier,
                "dp_delta": self.config.delta, "dp_accountant": self.config.accountant,
                "dp_private": self.private}

    def state_dict(self, generator_states: list[torch.Tensor]) -> dict[str, Any]:
        """Accountant history, generator kind and every rank's generator state (secret: it holds
        the noise key)."""
        history = [[float(s), float(q), int(n)] for s, q, n in self.accountant.history]
        return {"history": history, "generator": "os" if self.private else "seeded",
                "noise_seed": self.config.noise_seed, "generator_states": generator_states,
                "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate, "steps_per_epoch": self.steps_per_epoch,
                "accountant": self.config.accountant, "stopped": self.stopped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = state["generator"] if isinstance(state["generator"], str) else None
        mine = "os" if self.private else "seeded"
        if kind is None and self.private:
            raise ConfigError("the checkpoint does not say whether its DP noise was keyed from "
                              "the OS or from noise_seed (written by an older ember): it cannot "
                              "be resumed as a private run")
        if kind is not None and kind != mine:
            raise ConfigError(f"the checkpoint's DP noise generator was {kind!r}-keyed, this run's "
                              f"is {mine!r}: resume with the same noise_seed setting (a run "
                              f"with noise_seed is not private)")
        if kind == "seeded" and "noise_seed" not in state:
            raise ConfigError("the checkpoint does not record its noise_seed (written by an older "
                              "ember): it cannot be resumed")
        if kind == "seeded" and state["noise_seed"] != self.config.noise_seed:
            raise ConfigError(f"the checkpoint's DP noise was keyed from noise_seed="
                              f"{state['noise_seed']!r}, this run's from noise_seed="
                              f"{self.config.noise_seed!r}: resume with the same noise_seed")
        if state["accountant"] != self.config.accountant:
            raise ConfigError(f"checkpoint used the {state['accountant']!r} accountant, this run "
                              f"{self.config.accountant!r}")
        if state["noise_multiplier"] != self.noise_multiplier \
                or state["sample_rate"] != self.sample_rate:
            raise ConfigError("checkpoint was trained with another noise multiplier or sample rate "
                              f"({state['noise_multiplier']}, {state['sample_rate']}) than this run "
                              f"({self.noise_multiplier}, {self.sample_rate})")
        self.accountant.history = [(s, q, int(n)) for s, q, n in state["history"]]
        states = state.get("generator_states")
        self.generator.set_state(states[self.world.rank] if states is not None
                                 else state["generator"])
        self.stopped = bool(state.get("stopped", False))
        self.batches.drawn = self.steps

    def close(self) -> None:
        """Take Opacus's wrapping off the model (also after an error)."""
        try:
            self.module._close()
        finally:
            strip_opacus(self.model)


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                 config: PrivacyConfig, epochs: int, world: Any = None, *,
                 noise_multiplier: float | None = None) -> PrivateTraining:
    """Wrap model, optimizer and loader for DP-SGD (call :func:`check_model` first).

    ``noise_multiplier`` (a resumed run's) is used instead of searching one for
    ``config.epsilon`` over ``epochs``; ``config.noise_multiplier``, when set, wins."""
    from ember.train.distributed import World

    world = world or World()
    config.check()
    check_loader(loader, world)
    _opacus()
    from opacus.accountants.utils import create_accountant, get_noise_multiplier
    from opacus.grad_sample.utils import wrap_model

    import ember.csprng as csprng

    n, steps_per_epoch = len(loader.dataset), len(loader)
    if steps_per_epoch < 1:
        raise ConfigError("privacy: the training loader is empty")
    if world.distributed:
        from ember.train.distributed import all_gather_objects

        seen = all_gather_objects((n, steps_per_epoch), world)
        if len(set(seen)) != 1:
            raise ConfigError(f"privacy under several processes needs the same dataset and "
                              f"batch count on every rank, got (examples, batches) {seen}")
    delta = cast(float, config.delta)  # checked
    if delta >= 1 / n:
        warnings.warn(f"privacy delta={config.delta:g} is not below 1/N = 1/{n}: a mechanism "
                      f"that publishes one random record outright meets such a guarantee; use "
                      f"delta << 1/N", UserWarning, stacklevel=3)
    if config.noise_seed is not None:
        warnings.warn("PrivacyConfig(noise_seed=...) derives the DP noise and sampling from a "
                      "seed: anyone who knows it can remove the noise, so this run is not "
                      "private (for tests only)", UserWarning, stacklevel=3)
        base = csprng.create_generator(config.noise_seed)
    else:
        base = csprng.create_random_device_generator()
    generator = base.fold_in(world.rank)  # this rank's own stream (sampling; noise on rank 0)
    sample_rate = 1 / steps_per_epoch
    sigma = config.noise_multiplier if config.noise_multiplier is not None else noise_multiplier
    if sigma is None:
        steps = epochs * steps_per_epoch
        try:
            with warnings.catch_warnings():
                # the search tries huge multipliers, where RDP's best order is its largest one
                warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
                sigma = float(get_noise_multiplier(
                    target_epsilon=config.epsilon, target_delta=config.delta,
                    sample_rate=sample_rate, steps=steps, accountant=config.accountant))
        except ValueError as err:  # Opacus: "The privacy budget is too low."
            raise EpsilonTooLowError(
                f"privacy epsilon={config.epsilon:g} is too low for delta={config.delta:g} over "
                f"{steps} steps at sample rate {sample_rate:.4g}: no noise multiplier Opacus "
                f"searches reaches it ({err}); raise epsilon or delta or train fewer epochs",
                steps=steps, sample_rate=sample_rate) from None
    accountant = create_accountant(config.accountant)
    if world.distributed:  # Opacus's DPDDP: every rank starts from rank 0's weights
        for t in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(t.data, src=0)
    with warnings.catch_warnings():
        # Opacus warns that secure mode needs torchcsprng; ember's generator is what it means
        warnings.filterwarnings("ignore", message=".*[Ss]ecure.*")
        module = wrap_model(model, grad_sample_mode="hooks", batch_first=True,
                            loss_reduction="mean")
    dp_optimizer = _dp_optimizer(optimizer, sigma, cast(float, config.max_grad_norm),
                                 n * sample_rate,
                                 generator, world)
    dp_optimizer.attach_step_hook(
        lambda _: accountant.step(noise_multiplier=sigma, sample_rate=sample_rate))
    share = torch.arange(world.rank, n, world.size)  # DistributedPoissonSampler's shares
    batches = _PoissonBatches(share, sample_rate, steps_per_epoch, generator,
                              config.max_physical_batch_size, stop=lambda k: False)
    collate = loader.collate_fn
    dp_loader = torch.utils.data.DataLoader(
        loader.dataset, batch_sampler=batches, collate_fn=_CollateWithEmpty(collate, loader.dataset),
        num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn)
    return PrivateTraining(model, module, dp_optimizer, dp_loader, batches, generator, accountant,
                           config, sigma, sample_rate, steps_per_epoch, n, world)


def check_combination(config: Any, world: Any) -> None:
    """Refuse the :class:`~ember.train.TrainConfig` options DP-SGD cannot honour."""
    if config.precision != "fp32":
        raise ConfigError(f"privacy supports precision='fp32' only, got {config.precision!r}")
    if config.accumulate != 1:
        raise ConfigError("privacy does not support accumulate > 1: Poisson-sampled batches are "
                          "the unit the accountant counts (use PrivacyConfig("
                          "max_physical_batch_size=...) to bound memory)")
    if config.max_grad_norm is not None or config.max_grad_value is not None:
        raise ConfigError("with privacy, clipping is per example: set PrivacyConfig.max_grad_norm "
                          "and leave TrainConfig.max_grad_norm and max_grad_value None")
    if config.checkpoint_every is not None:
        raise ConfigError("privacy checkpoints at epoch ends only (checkpoint_every is not "
                          "supported: the Poisson sampler cannot resume mid-epoch)")


# ---------------------------------------------------------------------- fused secure-mode noise
def secure_noise(std: float, references: list[torch.Tensor], generator: Any) -> list[torch.Tensor]:
    """Opacus's secure-mode noise for each of ``references``, drawn with one ``normal_foreach_``.

    Exactly the values (and the generator position) of calling Opacus's
    ``_generate_noise(std, ref, generator, secure_mode=True)`` for each reference in order: per
    reference, one throw-away ``normal(0, std, (1, 1))`` and then ``(z1 + z2 + z3 + z4) / 2`` of four
    ``normal(0, std, ref.shape)`` draws (float32, the default dtype, as Opacus draws them), summed
    into zeros of the reference's dtype in that order.
    """
    from ember.csprng import normal_foreach_
    from ember.csprng.foreach import secure_noise_foreach_

    if std == 0:
        return [torch.zeros(r.shape, device=r.device, dtype=r.dtype) for r in references]
    if all(r.dtype == torch.float32 for r in references):  # one launch on CUDA
        return secure_noise_foreach_([torch.empty(r.shape, device=r.device) for r in references],
                                     float(std), generator=generator)
    draws: list[torch.Tensor] = []
    for r in references:
        draws.append(torch.empty((1, 1), device=r.device))
        draws.extend(torch.empty(r.shape, device=r.device) for _ in range(4))
    normal_foreach_(draws, float(std), generator=generator)
    noise = []
    for i, r in enumerate(references):
        total = torch.zeros(r.shape, device=r.device, dtype=r.dtype)
        for z in draws[5 * i + 1: 5 * i + 5]:
            total += z
        noise.append(total / 2)
    return noise


def fuse_secure_noise(optimizer: Any) -> bool:
    """Make an Opacus ``DPOptimizer`` in secure mode on an ember generator draw each step's noise
    for all parameters with :func:`secure_noise` (the same values, one pass instead of five calls
    per parameter). Returns False, changing nothing, for other optimizers and generators."""
    import ember.csprng as csprng

    try:
        from opacus.optimizers.optimizer import DPOptimizer, _check_processed_flag, _mark_as_processed
    except ImportError:
        return False
    if (getattr(type(optimizer), "add_noise", None) is not DPOptimizer.add_noise
            or not optimizer.secure_mode
            or not csprng.is_generator(optimizer.generator)):
        return False

    def add_noise() -> None:
        params = list(optimizer.params)
        for p in params:
            _check_processed_flag(p.summed_grad)
        std = optimizer.noise_multiplier * optimizer.max_grad_norm
        noises = secure_noise(std, [p.summed_grad for p in params], optimizer.generator)
        for p, noise in zip(params, noises, strict=True):
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)

    optimizer.add_noise = add_noise
    return True
