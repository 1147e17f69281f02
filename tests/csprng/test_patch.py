"""ember.csprng checks torch's private names it relies on at import, and fails closed without one."""

import subprocess
import sys
import textwrap

import pytest
import torch

import ember.csprng as csprng
from ember.csprng import patch


def test_every_hook_exists_in_this_torch():
    missing = [h.name for h in patch.HOOKS if h.required and patch._broken(h)]
    assert missing == []


def _import_without(module: str, attr: str, replacement: str = "") -> subprocess.CompletedProcess:
    change = f"setattr(mod, {attr!r}, {replacement})" if replacement else f"delattr(mod, {attr!r})"
    code = textwrap.dedent(f"""
        import importlib, torch
        mod = importlib.import_module({module!r})
        {change}
        try:
            import ember.csprng
        except ImportError as e:
            print(type(e).__name__)
            print(e)
        else:
            g = ember.csprng.create_generator(1)
            print("imported", torch.rand(2, generator=g))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)


@pytest.mark.parametrize("module,attr,replacement", [
    ("torch.utils._device", "_device_constructors", ""),
    ("torch.utils.data.dataloader", "_BaseDataLoaderIter", ""),
    ("torch._C._functorch", "peek_interpreter_stack", ""),
    ("torch.utils._device", "_device_constructors", "lambda: {}"),  # another shape: a dict
])
def test_import_fails_closed_naming_the_torch_version(module, attr, replacement):
    done = _import_without(module, attr, replacement)
    lines = done.stdout.splitlines()
    assert lines[0] == "TorchIncompatible", done.stdout + done.stderr
    assert torch.__version__ in lines[1]
    assert f"{module}.{attr}" in lines[1]


def test_get_names_the_missing_hook(monkeypatch):
    import torch.utils.data.graph_settings as graph_settings

    monkeypatch.delattr(graph_settings, "get_all_graph_pipes")
    with pytest.raises(patch.TorchIncompatible,
                       match=r"torch\.utils\.data\.graph_settings\.get_all_graph_pipes"):
        patch.get("torch.utils.data.graph_settings.get_all_graph_pipes")


def test_version_counter_setter_takes_either_calling_convention():
    calls = []

    def older(t, v):  # one tensor and one int, as torch 2.4's
        if not isinstance(t, torch.Tensor):
            raise TypeError("incompatible function arguments")
        calls.append(("older", v))

    def newer(ts, vs):  # tuples, as newer torch's
        if not isinstance(ts, tuple):
            raise TypeError("incompatible function arguments")
        calls.append(("newer", vs))

    t = torch.empty(2)
    patch._version_setter(older)(t, 7)
    patch._version_setter(newer)(t, 8)
    assert calls[-1] == ("newer", (8,)) and ("older", 7) in calls
    assert patch._version_setter(lambda *a: (_ for _ in ()).throw(TypeError())) is None


def test_an_in_place_draw_bumps_the_version_counter():
    x = torch.empty(4)
    before = x._version
    x.normal_(generator=csprng.create_generator(1))
    assert x._version == before + 1


def test_like_factories_are_routed_only_where_torch_takes_a_generator():
    def without(input, *args):  # torch 2.4's rand_like: no generator= parameter
        return torch.empty_like(input)

    def with_generator(input, *args, generator=None):
        return torch.empty_like(input)

    assert not patch.takes_generator("rand_like", without)
    assert patch.takes_generator("randint_like", with_generator)
    assert patch.takes_generator("rand", without)  # not a late one: always routed
