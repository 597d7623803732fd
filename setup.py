"""Builds the optional native I/O engine; pyproject.toml remains the source of all metadata.

The engine (native/tba_engine.c) is a plain C shared library with no Python headers, loaded by
tba/storage/_native_lib.py with ctypes. It is declared ``optional``: when the C compiler is missing
or fails, setuptools prints a warning and the install goes on without it (``tba`` then reports
the engine as not built, and the other backends work as before).
"""

from setuptools import Extension, setup

engine = Extension(
    "tba._engine",
    sources=["native/tba_engine.c"],
    depends=["native/tba_engine.h"],
    include_dirs=["native"],
    language="c",
    extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-fvisibility=default"],
    extra_link_args=["-pthread"],
    optional=True,
)

setup(ext_modules=[engine])
