"""Build configuration that pyproject.toml cannot express: the compiled max-flow kernel.

Everything else (metadata, packages, data) lives in pyproject.toml.
"""

import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

KERNEL = Extension(
    "attnflow._maxflow_kernel",
    sources=["attnflow/_maxflow_kernel.pyx"],
    # Plain arithmetic on doubles: never -ffast-math, which would break the exact residuals.
    extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
)

setup(ext_modules=cythonize([KERNEL], language_level=3))
