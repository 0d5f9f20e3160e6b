"""Build configuration that pyproject.toml cannot express: the compiled kernels.

The max-flow solver, the fused pass of gradient-weighted rollout (whose value-check
reductions are vectorised by ``omp simd``: -fopenmp-simd, no OpenMP runtime), and the
value-aware token-mixing rules (ALTI's Manhattan distances, the Gram-matrix norms).

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

GAE_KERNEL = Extension(
    "attnflow._gae_kernel",
    sources=["attnflow/_gae_kernel.pyx"],
    depends=["attnflow/_gae_kernel.h"],
    extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3", "-fopenmp-simd"],
)

CONTRIBUTIONS_KERNEL = Extension(
    "attnflow._contributions_kernel",
    sources=["attnflow/_contributions_kernel.pyx"],
    depends=["attnflow/_contributions_kernel.h"],
    # Never -ffast-math (ALTI subtracts two large norms); the Gram matrices' dot products
    # are vectorised by ``omp simd`` (-fopenmp-simd, no OpenMP runtime).
    extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3", "-fopenmp-simd"],
)

setup(ext_modules=cythonize([KERNEL, GAE_KERNEL, CONTRIBUTIONS_KERNEL], language_level=3))
