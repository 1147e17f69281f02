"""``ember demo``: a pre-specified experiment on scikit-learn's bundled digits data (no download)."""

# what ``ember.demo`` exposed as one module; the names used elsewhere are re-exported with "as"
from ember.demo.protocol import DEFAULT_OUT as DEFAULT_OUT
from ember.demo.protocol import METHODS as METHODS
from ember.demo.protocol import PROTOCOL, DemoSettings, register, run_demo, write_digits_shards
from ember.demo.protocol import TEST_SETS as TEST_SETS
from ember.demo.protocol import _main as _main
from ember.demo.protocol import format_results as format_results
from ember.demo.protocol import shifted_test_sets as shifted_test_sets

__all__ = ["DemoSettings", "PROTOCOL", "register", "run_demo", "write_digits_shards"]
