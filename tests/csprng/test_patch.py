"""ember.csprng checks torch's private names it relies on at import, and fails closed without one."""

import subprocess
import sys
import textwrap

import pytest
import torch

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
    import torch.nn.init

    monkeypatch.delattr(torch.nn.init, "_make_deprecate")
    with pytest.raises(patch.TorchIncompatible, match=r"torch\.nn\.init\._make_deprecate"):
        patch.get("torch.nn.init._make_deprecate")
