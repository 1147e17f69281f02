"""The demo needs scikit-learn's bundled digits; without it these tests are skipped."""

import pytest

pytest.importorskip("sklearn")
