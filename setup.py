"""Build configuration that pyproject.toml cannot express: the compiled kernels.

The max-flow solver, the fused pass of gradient-weighted rollout (whose value-check
reductions are vectorised by ``omp simd``: -fopenmp-simd, no OpenMP runtime), and ALTI's
Manhattan distances.

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

ALTI_KERNEL = Extension(
    "attnflow._alti_kernel",
    sources=["attnflow/_alti_kernel.pyx"],
    depends=["attnflow/_alti_kernel.h"],
    # Plain arithmetic (never -ffast-math): ALTI subtracts two large norms.
    extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
)

setup(ext_modules=cythonize([KERNEL, GAE_KERNEL, ALTI_KERNEL], language_level=3))
