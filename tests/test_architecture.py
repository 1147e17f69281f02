"""ember's layers point one way (docs/architecture.md): csprng, shards and swa at the bottom, train
above them, the CLI and the demo on top. No module imports a module of a higher layer, not even
inside a function, through ``importlib.import_module`` with a literal name (absolute or relative,
under any alias), or through an attribute of the ``ember`` package (``ember.train``). The package's
own ``__init__`` counts as the bottom layer. Names computed at run time cannot be checked here;
ember uses them only for third-party codecs (shards.decode, shards.writer) and the CLI's commands."""

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
    """The layer of a module of the ember package (``ember`` itself: 0); None outside it."""
    parts = module.split(".")
    if parts[0] != "ember":
        return None
    return LAYERS.get(parts[1], -1) if len(parts) > 1 else 0


class _Imports(ast.NodeVisitor):
    """Every module a file imports, with the function it is imported in (None: module level)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, int, tuple[str, ...]]] = []  # (module, line, enclosing defs)
        self.function: list[str] = []
        self.dynamic = set(_DYNAMIC)  # names under which import_module is called here

    def _add(self, target: str, node: ast.AST) -> None:
        self.found.append((target, node.lineno, tuple(self.function)))

    def _absolute(self, name: str, level: int, package: str) -> str:
        if not level:
            return name
        anchor = package.split(".")
        anchor = anchor[:len(anchor) - (level - 1)]
        return ".".join(anchor + ([name] if name else []))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.function.append(node.name)
        self.generic_visit(node)
        self.function.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module or "", node.level, self.package)
        if base == "importlib":
            self.dynamic.update(a.asname or a.name for a in node.names if a.name in _DYNAMIC)
        for alias in node.names:  # `from ember import train` imports the module ember.train
            self._add(f"{base}.{alias.name}" if alias.name != "*" else base, node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        # `import ember` followed by `ember.train.fit` reaches the higher layer all the same
        if isinstance(node.value, ast.Name) and node.value.id == "ember":
            self._add(f"ember.{node.attr}", node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if (name in self.dynamic and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            target = node.args[0].value
            if target.startswith("."):  # import_module(".train", "ember") or package="ember"
                package = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
                package += [k.value.value for k in node.keywords
                            if k.arg == "package" and isinstance(k.value, ast.Constant)]
                stripped = target.lstrip(".")
                target = self._absolute(stripped, len(target) - len(stripped),
                                        package[0] if package else self.package)
            self._add(target, node)
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
        for target, line, scope in visitor.found:
            there = _layer(target)
            if there is None or there <= here:
                continue
            if scope == ("__getattr__",) and (module, target) in SHIMS:  # the module's own only
                continue
            where = f"in {'.'.join(scope)}()" if scope else "at module level"
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


def test_every_module_is_named_in_the_ownership_table():
    # the table of docs/architecture.md went stale once (seven modules added after it was written)
    doc = (SRC.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Which module owns what"):]
    missing = sorted(str(p.relative_to(SRC)) for p in (SRC / "ember").rglob("*.py")
                     if p.stem != "__init__" and not p.stem.startswith("_")
                     and f"`{p.stem}`" not in table and f"`ember.{p.stem}`" not in table)
    assert missing == [], "name these modules in docs/architecture.md's table"


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
    "import importlib\nimportlib.import_module('.train.loop', 'ember')\n",
    "import importlib\nimportlib.import_module('..train', package='ember.swa')\n",
    "from importlib import import_module as im\nim('ember.train.loop')\n",
    "import ember\n\ndef f():\n    return ember.train\n",
])
def test_an_upward_import_is_found(tmp_path, code):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "swa/__init__.py", "")
    _write(tmp_path, "swa/multiswa.py", code)
    found = upward_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("ember/swa/multiswa.py:"), found


def test_a_shim_name_on_a_method_is_not_exempt(tmp_path):
    _write(tmp_path, "__init__.py", "")
    _write(tmp_path, "swa/__init__.py", "")
    _write(tmp_path, "swa/swap.py",
           "class C:\n    def __getattr__(self, name):\n        from ember.train.recipes import swap\n")
    assert len(upward_imports(tmp_path)) == 1


def test_the_package_init_counts_as_the_bottom_layer(tmp_path):
    _write(tmp_path, "__init__.py", "import ember.train.recipes\n")
    _write(tmp_path, "swa/__init__.py", "")
    found = upward_imports(tmp_path)
    assert len(found) == 1 and found[0].startswith("ember/__init__.py:"), found


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
