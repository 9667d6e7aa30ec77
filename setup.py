"""The one compiled part: router/_fastkeys.c (chained block keys; see its header for why). Optional: where no C
compiler is found the build goes on without it and router/keys.py computes the same keys in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("router._fastkeys", ["router/_fastkeys.c"], optional=True,
                             extra_compile_args=["-O2"])])
