"""Build configuration beyond pyproject.toml: ember's optional C extensions.

``ember.shards._speedups`` speeds up tar header parsing; ember.shards.tar falls back to its
pure-Python parser where the extension is not built (no C compiler). ``ember.csprng._shuffle``
is randperm's bucket scatter and Fisher-Yates; ember.csprng.shuffle falls back to NumPy twins
(same values, slower). ``ember.csprng._transforms`` turns keystream words into randint's and
rand's values in one pass; ember.csprng.transforms falls back to NumPy (same values). So a failed
build is not an install failure.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("ember.shards._speedups", ["src/ember/shards/_speedups.c"], optional=True),
        Extension("ember.csprng._shuffle", ["src/ember/csprng/_shuffle.c"],
                  depends=["src/ember/csprng/_buffers.h"], optional=True),
        Extension("ember.csprng._transforms", ["src/ember/csprng/_transforms.c"],
                  depends=["src/ember/csprng/_buffers.h"], optional=True),
    ]
)
