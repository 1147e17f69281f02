"""No torch path returns values from an ember generator that did not come from ember's stream.

Every function that takes a generator in this torch (enumerated from torch's own operator schemas
and Python signatures, so that new ones are caught) is called with ember generators: it either
raises before returning, or returns values that come from ember's stream (they advance its counter,
repeat for equal seeds and differ between independent random-device generators).
"""

import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ember.csprng as csprng

N = 64  # elements per draw: two independent generators agree on all of them with negligible odds
# Arguments are chosen so that every random decision of a call is taken: probabilities strictly
# between 0 and 1, ranges of positive width, non-zero sparsity, Poisson rates on both sides of the
# method switch at 10.
POISSON_RATES = torch.logspace(-1, 6, N)


def _value(arg, ints, floats, op="") -> object:
    """A valid argument for the schema argument ``arg`` of ``op`` (None: leave it out)."""
    t = str(arg.type)
    if arg.name == "generator":
        return None
    if arg.has_default_value():
        return None
    if t == "Tensor":
        return POISSON_RATES.clone() if "poisson" in op else torch.full((N,), 0.5)
    if t in ("int", "SymInt"):  # a size, a bound or a count; increasing, for (low, high)
        return next(ints)
    if t in ("List[int]", "List[SymInt]"):
        return [N]
    if t in ("float", "Scalar"):  # increasing, for (low, high) and (mean, std)
        return next(floats)
    if t == "bool":
        return False
    raise LookupError(t)


def _schema_calls():
    """(schema name, overload, args, kwargs) for every operator schema with a generator."""
    calls = []
    for s in torch._C._jit_get_all_schemas():
        if not any(a.name == "generator" for a in s.arguments):
            continue
        args, kwargs, ok, ints = [], {}, True, iter((10, 50, 60))
        floats = iter((0.25, 0.75, 0.9))
        for a in s.arguments:
            try:
                v = _value(a, ints, floats, s.name)
            except LookupError:
                ok = False
                break
            if v is None:
                continue
            if a.kwarg_only:
                kwargs[a.name] = torch.empty(N) if a.name == "out" else v
            else:
                args.append(v)
        if ok:
            calls.append((s.name, s.overload_name, args, kwargs))
    return calls


SCHEMA_CALLS = _schema_calls()


def _fresh(args, kwargs):
    clone = (lambda v: v.clone() if isinstance(v, torch.Tensor) else v)
    return [clone(a) for a in args], {k: clone(v) for k, v in kwargs.items()}


def _works_with_torch(fn, args, kwargs) -> bool:
    a, k = _fresh(args, kwargs)
    try:
        fn(*a, **k, generator=torch.Generator().manual_seed(3))
    except Exception:
        return False
    return True


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out.detach().clone()]
    if isinstance(out, torch.utils.data.Subset):  # random_split
        return [torch.tensor(out.indices)]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _check_ember_or_raise(label, fn, args, kwargs):
    """``fn`` raises for ember generators, or returns ember's values."""
    outs, counters = [], []
    for g in (csprng.create_random_device_generator(), csprng.create_random_device_generator(),
              csprng.create_generator(11), csprng.create_generator(11)):
        a, k = _fresh(args, kwargs)
        try:
            out = fn(*a, **k, generator=g)
        except Exception:
            return "raised"
        outs.append(_flat(out) + _flat(a))
        counters.append(g.counter)
    assert all(c > 0 for c in counters), f"{label} returned without drawing from ember's stream"
    rd1, rd2, s1, s2 = outs
    assert all(torch.equal(x, y) for x, y in zip(s1, s2, strict=True)), label
    assert not all(torch.equal(x, y) for x, y in zip(rd1, rd2, strict=True)), (
        f"{label}: two independent random-device generators gave the same values")
    return "ember"


def _bindings(name):
    """The Python-level bindings of the aten operator ``name``."""
    short = name.split("::")[1]
    owners = {"torch": torch, "torch._C._VariableFunctions": torch._C._VariableFunctions,
              "torch._C._nn": torch._C._nn, "torch._C._special": torch._C._special,
              "torch.nn.functional": torch.nn.functional, "torch.special": torch.special}
    found = [(f"{n}.{short}", getattr(o, short)) for n, o in owners.items() if hasattr(o, short)]
    for cls in (torch.Tensor, torch._C.TensorBase):
        if hasattr(cls, short):
            meth = getattr(cls, short)
            found.append((f"{cls.__name__}.{short}",
                          lambda *a, _m=meth, **k: _m(a[0], *a[1:], **k)))
    return found


def test_the_enumeration_finds_torch_random_operators():
    names = {c[0] for c in SCHEMA_CALLS}
    for op in ("aten::normal", "aten::rand", "aten::randperm", "aten::bernoulli",
               "aten::uniform_", "aten::random_", "aten::rrelu_with_noise", "aten::multinomial"):
        assert op in names


@pytest.mark.parametrize("name,overload,args,kwargs", SCHEMA_CALLS,
                         ids=[f"{c[0]}.{c[1] or 'default'}" for c in SCHEMA_CALLS])
def test_every_operator_schema_raises_or_gives_ember_values(name, overload, args, kwargs):
    ns, short = name.split("::")
    packet = getattr(getattr(torch.ops, ns), short)
    op = getattr(packet, overload or "default")
    tried = 0
    for label, fn in [(f"torch.ops.{ns}.{short}.{overload or 'default'}", op)] + _bindings(name):
        if not _works_with_torch(fn, args, kwargs):
            continue  # these arguments do not fit this binding even for torch's own generator
        tried += 1
        _check_ember_or_raise(label, fn, args, kwargs)
    if tried == 0:
        pytest.skip(f"no binding of {name}.{overload} accepts the synthetic arguments")


def _python_functions():
    """Python-level callables whose signature has a ``generator`` parameter."""
    found = {}
    for mod in (torch, torch.Tensor, torch.nn.functional, torch.nn.init, torch.special,
                torch.utils.data):
        for attr in dir(mod):
            fn = getattr(mod, attr, None)
            if not callable(fn) or isinstance(fn, type):
                continue
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if "generator" in params:
                found[f"{getattr(mod, '__name__', mod)}.{attr}"] = fn
    return found


PYTHON_FUNCTIONS = _python_functions()


def test_python_level_functions_with_a_generator_are_found():
    assert "torch.nn.init.normal_" in PYTHON_FUNCTIONS
    assert "torch.nn.init.kaiming_uniform_" in PYTHON_FUNCTIONS


# Tried in this order; the first that torch's own generator accepts is used. The ones with a second
# argument come first so that it is given where a function takes one (sparse_'s sparsity 0.5, not
# a default or 0); values are 0.5 rather than uninitialised memory (probabilities, means).
PYTHON_ARGS = (
    [torch.full((8, 8), 0.5), 0.5], [torch.full((8, 8), 0.5), 0.25, 1.0, -2.0, 2.0],
    [torch.full((8, 8), 0.5), 0.25, 1.0], [torch.full((8, 8), 0.5)], [torch.full((N,), 0.5)],
    [list(range(N)), [N // 2, N // 2]],
)


def _python_args(fn):
    for args in PYTHON_ARGS:
        if _works_with_torch(fn, args, {}):
            return args
    return None


def test_python_functions_get_arguments_that_take_every_random_decision():
    for name in ("torch.nn.init.sparse_", "torch.nn.init.sparse"):
        if name in PYTHON_FUNCTIONS:
            args = _python_args(PYTHON_FUNCTIONS[name])
            assert args is not None and 0 < args[1] < 1, (name, args)


@pytest.mark.parametrize("label", sorted(PYTHON_FUNCTIONS))
def test_every_python_function_raises_or_gives_ember_values(label):
    fn = PYTHON_FUNCTIONS[label]
    args = _python_args(fn)
    if args is None:
        pytest.skip(f"{label}: no synthetic arguments fit")
    assert _check_ember_or_raise(label, fn, args, {}) in ("ember", "raised")


@pytest.mark.parametrize("call", [
    lambda g: torch.ops.aten.normal(0.0, 1.0, [N], generator=g),
    lambda g: torch.ops.aten.normal.float_float(0.0, 1.0, [N], generator=g),
    lambda g: torch.ops.aten.uniform_(torch.empty(N), generator=g),
    lambda g: torch.ops.aten.rand([N], generator=g),
    lambda g: torch.ops.aten.rand.generator([N], generator=g),
    lambda g: torch.ops.aten.randperm(N, generator=g),
    lambda g: torch.ops.aten.randperm.generator(N, generator=g),
    lambda g: torch.ops.aten.bernoulli(torch.full((N,), 0.5), generator=g),
    lambda g: torch._C._VariableFunctions.randn(N, generator=g),
    lambda g: torch._C._VariableFunctions.rand(N, generator=g),
    lambda g: torch._C.TensorBase.normal_(torch.empty(N), generator=g),
    lambda g: torch._C.TensorBase.random_(torch.empty(N), generator=g),
    lambda g: torch._C._nn.rrelu_with_noise(torch.randn(N), torch.empty(N), 0.1, 0.3, True, g),
], ids=["aten.normal", "aten.normal.float_float", "aten.uniform_", "aten.rand",
        "aten.rand.generator", "aten.randperm", "aten.randperm.generator", "aten.bernoulli",
        "VF.randn", "VF.rand", "TensorBase.normal_", "TensorBase.random_", "rrelu_with_noise"])
def test_named_bypass_paths_raise_before_returning(call):
    g = csprng.create_random_device_generator()
    with pytest.raises((TypeError, RuntimeError)):
        call(g)
    # and the generator is not spoiled for the routed paths afterwards
    assert torch.rand(4, generator=g).shape == (4,)


def test_functions_bound_before_ember_was_imported_raise(tmp_path):
    code = textwrap.dedent("""
        from torch import randn, rand, randperm, normal
        import torch
        early = torch.Tensor.normal_
        import ember.csprng as csprng
        g1, g2 = csprng.create_random_device_generator(), csprng.create_random_device_generator()
        for name, call in [("randn", lambda g: randn(8, generator=g)),
                           ("rand", lambda g: rand(8, generator=g)),
                           ("randperm", lambda g: randperm(8, generator=g)),
                           ("normal", lambda g: normal(0.0, 1.0, (8,), generator=g)),
                           ("Tensor.normal_", lambda g: early(torch.empty(8), generator=g))]:
            try:
                a, b = call(g1), call(g2)
            except (TypeError, RuntimeError):
                print(name, "raised")
            else:
                print(name, "RETURNED", "same" if bool((a == b).all()) else "different")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("\n")
    assert [ln for ln in lines if ln] == [
        "randn raised", "rand raised", "randperm raised", "normal raised", "Tensor.normal_ raised"]


def test_independent_generators_never_share_values_on_routed_paths():
    a, b = csprng.create_random_device_generator(), csprng.create_random_device_generator()
    for call in (lambda g: torch.randn(N, generator=g), lambda g: torch.rand(N, generator=g),
                 lambda g: torch.randperm(N, generator=g),
                 lambda g: torch.empty(N).normal_(generator=g),
                 lambda g: torch.empty(N, dtype=torch.int64).random_(generator=g)):
        assert not torch.equal(call(a), call(b))
