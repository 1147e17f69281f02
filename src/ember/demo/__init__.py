"""``ember demo``: a pre-specified experiment on scikit-learn's bundled digits data (no download).

What each part of ember is for, shown in one run:

- ember.shards: the digits are written as PNG + cls tar shards and streamed back, with the sample
  shuffle drawn by an ember.csprng generator;
- ember.swa: SGD, SWA, SWAG and MultiSWAG compared where weight averaging is claimed to help, with
  40% of the training labels wrong and test images that differ from the training images;
- ember.train: every model is trained by ``fit``;
- ember.csprng: DP-SGD through Opacus with ember's generator as Opacus's secure RNG, and speed
  ratios against torch's default generator measured in this run.

The protocol (``PROTOCOL``, printed before any number) was fixed before the first run and is not
tuned to the results. Outputs: ``results.json``, the PNG figures and a self-contained
``report.html``.

Modules: :mod:`ember.demo.protocol` (protocol, data, runs, DP, speed), :mod:`ember.demo.figures`,
:mod:`ember.demo.report` (tables, report.html) and :mod:`ember.demo.run` (``run_demo``, the
``ember demo`` command).
"""

# names that ``ember.demo`` exposed as one module, used by the CLI, tests and benchmarks
from ember.demo.protocol import DEFAULT_OUT as DEFAULT_OUT
from ember.demo.protocol import METHODS as METHODS
from ember.demo.protocol import PROTOCOL, DemoSettings, write_digits_shards
from ember.demo.protocol import TEST_SETS as TEST_SETS
from ember.demo.protocol import shifted_test_sets as shifted_test_sets
from ember.demo.report import format_results as format_results
from ember.demo.run import _main as _main
from ember.demo.run import register, run_demo

__all__ = ["DemoSettings", "PROTOCOL", "register", "run_demo", "write_digits_shards"]
