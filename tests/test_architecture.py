"""ember's layers point one way (docs/architecture.md): csprng, shards and swa at the bottom, train
above them, the CLI and the demo on top. No module imports a module of a higher layer, not even
inside a function or through ``importlib.import_module("...")``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# the layer of each top-level part of the ember package (a subpackage or a module)
LAYERS = {"csprng": 0, "shards": 0, "swa": 0, "train": 1, "cli": 2, "bench_cli": 2, "demo": 2}

# The only upward references allowed: the deprecation shims that keep the old ember.swa paths of
# the training procedures working until ember 0.2 (docs/architecture.md). They import inside
# the module's __getattr__, so importing ember.swa never imports ember.train; remove them then.
SHIMS = {
    ("ember.swa", "ember.train.recipes"),
    ("ember.swa.multiswa", "ember.train.recipes.multiswa"),
    ("ember.swa.swap", "ember.train.recipes.swap"),
}
_DYNAMIC = {"import_module", "__import__"}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int | None:
    """The layer of a module of the ember package; None for ``ember`` itself and outside it."""
    parts = module.split(".")
    if parts[0] != "ember" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1], -1)


class _Imports(ast.NodeVisitor):
    """Every module a file imports, with the function it is imported in (None: module level)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, int, str | None]] = []  # (module, line, function)
        self.function: list[str] = []

    def _add(self, target: str, node: ast.AST) -> None:
        self.found.append((target, node.lineno, self.function[-1] if self.function else None))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:  # `from ember import train` imports the module ember.train
            self._add(f"{base}.{alias.name}" if alias.name != "*" else base, node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if (name in _DYNAMIC and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def upward_imports(src: Path) -> list[str]:
    """Every import under ``src/ember`` of a module from a higher layer, as readable lines."""
    root = src
    bad = []
    for path in sorted((root / "ember").rglob("*.py")):
        module = _module_name(root, path)
        here = _layer(module)
        if here is None:
            continue
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for target, line, function in visitor.found:
            there = _layer(target)
            if there is None or there <= here:
                continue
            if function == "__getattr__" and (module, target) in SHIMS:
                continue
            where = f"in {function}()" if function else "at module level"
            bad.append(f"{path.relative_to(root)}:{line}: {module} (layer {here}) imports "
                       f"{target} (layer {there}) {where}")
    return bad


def test_no_module_imports_a_higher_layer():
    assert upward_imports(SRC) == []


def test_every_part_of_ember_has_a_layer():
    parts = {p.stem for p in (SRC / "ember").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert parts - LAYERS.keys() == set(), "place the new part in LAYERS and docs/architecture.md"


def _write(root: Path, rel: str, text: str) -> None:
    path = root / "ember" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("code", [
    "import ember.train\n",
    "from ember.train.loop import fit\n",
    "from ember import train\n",
    "from ..train import loop\n",
    "from .. import demo\n",
    "def f():\n    from ember.train import fit\n",
    "class C:\n    def m(self):\n        import ember.cli\n",
    "import importlib\n\ndef f():\n    return importlib.import_module('ember.train.loop')\n",
    "def f():\n    return __import__('ember.demo')\n",
    "def __getattr__(name):\n    from ember.train import recipes\n",  # a shim elsewhere
])
def test_an_upward_import_is_found(tmp_path, code):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "swa/__init__.py", "")
    _write(tmp_path, "swa/multiswa.py", code)
    found = upward_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("ember/swa/multiswa.py:"), found


@pytest.mark.parametrize("code", [
    "from ember.swa import bn\nfrom ember.csprng import create_generator\n",  # same layer
    "import torch\nfrom . import bn\n",
    "def __getattr__(name):\n    from ember.train.recipes import multiswa\n",  # the shim
])
def test_same_layer_imports_and_the_shims_pass(tmp_path, code):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "swa/__init__.py", "")
    _write(tmp_path, "swa/multiswa.py", code)
    assert upward_imports(tmp_path) == []


def test_downward_imports_pass(tmp_path):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "demo/__init__.py", "from ember.train import fit\nfrom ember.swa import SWA\n")
    _write(tmp_path, "train/loop.py", "from ember.swa import SWA\nfrom ..shards import plan\n")
    assert upward_imports(tmp_path) == []
