"""Training procedures built on :func:`ember.train.fit` and ember.swa's averaging objects.

Multi-SWA (:func:`train_multiswa`) and SWAP (:func:`swap_fit`, :func:`refine_and_average`,
:func:`refine_locally`) run training; the objects they average with stay in :mod:`ember.swa`.
"""

from ember.train.recipes.multiswa import train_multiswa
from ember.train.recipes.swap import SWAPResult, refine_and_average, refine_locally, swap_fit

__all__ = ["SWAPResult", "refine_and_average", "refine_locally", "swap_fit", "train_multiswa"]
