"""Build configuration beyond pyproject.toml: ember's one optional C extension.

``ember.shards._speedups`` speeds up tar header parsing; ember.shards.tar falls back to its
pure-Python parser where the extension is not built (no C compiler), so a failed build is not
an install failure.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("ember.shards._speedups", ["src/ember/shards/_speedups.c"], optional=True),
    ]
)
