"""Builds kiln's optional native extension; the package works without it (reference path)."""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

native = Pybind11Extension(
    "kiln.tokenizer._native",
    sources=["kiln/tokenizer/csrc/native.cpp"],
    include_dirs=["kiln/tokenizer/csrc"],
    cxx_std=17,
    extra_compile_args=["-O3"],
)
# optional=True: a failed compile leaves the pure-Python reference path (with a warning at import).
native.optional = True

setup(ext_modules=[native])
