"""The training procedures moved from ember.swa to ember.train.recipes: the old import paths still
work for one release and warn."""

import importlib
import subprocess
import sys

import pytest

import ember.train.recipes.multiswa as new_multiswa
import ember.train.recipes.swap as new_swap

MOVED = [
    ("ember.swa", "train_multiswa", new_multiswa),
    ("ember.swa", "swap_fit", new_swap),
    ("ember.swa", "refine_and_average", new_swap),
    ("ember.swa", "refine_locally", new_swap),
    ("ember.swa", "SWAPResult", new_swap),
    ("ember.swa.multiswa", "train_multiswa", new_multiswa),
    ("ember.swa.swap", "swap_fit", new_swap),
    ("ember.swa.swap", "refine_and_average", new_swap),
    ("ember.swa.swap", "refine_locally", new_swap),
    ("ember.swa.swap", "SWAPResult", new_swap),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_old_path_warns_and_gives_the_moved_object(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"{name} has moved to {new.__name__}.{name}"):
        obj = getattr(module, name)
    assert obj is getattr(new, name)


def test_from_import_of_an_old_name_warns():
    with pytest.warns(DeprecationWarning, match="ember.train.recipes.multiswa.train_multiswa"):
        from ember.swa import train_multiswa
    assert train_multiswa is new_multiswa.train_multiswa


@pytest.mark.parametrize("module", ["ember.swa", "ember.swa.swap", "ember.swa.multiswa"])
def test_unknown_names_still_raise_attribute_error(module):
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = importlib.import_module(module).no_such_name


def test_importing_ember_swa_does_not_import_ember_train():
    code = ("import sys, ember.swa, ember.swa.swap, ember.swa.multiswa; "
            "print(sorted(m for m in sys.modules if m.startswith('ember.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("old", ["ember.swa", "ember.swa.swap", "ember.swa.multiswa"])
def test_moved_names_stay_listed_by_dir_without_a_warning(old, recwarn):
    module = importlib.import_module(old)
    names = {name for o, name, _ in MOVED if o == old}
    assert names <= set(dir(module))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
