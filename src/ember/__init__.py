"""ember: training infrastructure for PyTorch.

Subsystems (import them directly; nothing heavy is imported here):

- :mod:`ember.csprng`: cryptographically secure generators that plug into ``generator=``.
- :mod:`ember.shards`: streaming of WebDataset-format tar shards.
- :mod:`ember.swa`: SWA, EMA, SWAG and calibration metrics.
- :mod:`ember.train`: a small explicit training loop.
"""

__version__ = "0.1.0"
