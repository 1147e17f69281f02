"""Shared fixtures: the digits data written once per session as PNG + cls shards."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sklearn")


@pytest.fixture(scope="session")
def digits_shards(tmp_path_factory) -> dict:
    from ember.demo import write_digits_shards

    root = Path(tmp_path_factory.mktemp("digits"))
    written = write_digits_shards(root, maxcount=200)
    return {"root": root, "train": written["train"], "test": written["test"],
            "n_train": written["n_train"], "n_test": written["n_test"],
            "train_small": str(root / "train-{000000..000001}.tar")}
