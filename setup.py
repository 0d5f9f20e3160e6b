"""Build configuration that pyproject.toml cannot express: the compiled kernels.

The max-flow solver, the fused pass of gradient-weighted rollout (whose value-check
reductions are vectorised by ``omp simd``: -fopenmp-simd, no OpenMP runtime), and the
value-aware token-mixing rules (ALTI's Manhattan distances, the Gram-matrix norms), and
the proximities of information flow routes (IFR's Manhattan distances).

The kernels are built without debug information (``-g0``, and the linker strips what
the interpreter's own flags add: ``-s``): debug sections made up 4.9 MB of a 7.0 MB wheel,
and a user's traceback never reaches into them.

Everything else (metadata, packages, data) lives in pyproject.toml.
"""

import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

WINDOWS = sys.platform == "win32"
# Optimised, no debug sections: -g0 after the interpreter's own -g (the last one wins),
# and -s at link time strips the symbol tables too.
OPTIMISE = ["/O2"] if WINDOWS else ["-O3", "-g0"]
STRIP = [] if WINDOWS or sys.platform == "darwin" else ["-s"]

KERNEL = Extension(
    "attnflow._maxflow_kernel",
    sources=["attnflow/_maxflow_kernel.pyx"],
    # Plain arithmetic on doubles: never -ffast-math, which would break the exact residuals.
    extra_compile_args=OPTIMISE,
    extra_link_args=STRIP,
)

GAE_KERNEL = Extension(
    "attnflow._gae_kernel",
    sources=["attnflow/_gae_kernel.pyx"],
    depends=["attnflow/_gae_kernel.h"],
    extra_compile_args=OPTIMISE if WINDOWS else [*OPTIMISE, "-fopenmp-simd"],
    extra_link_args=STRIP,
)

CONTRIBUTIONS_KERNEL = Extension(
    "attnflow._contributions_kernel",
    sources=["attnflow/_contributions_kernel.pyx"],
    depends=["attnflow/_contributions_kernel.h"],
    # Never -ffast-math (ALTI subtracts two large norms); the Gram matrices' dot products
    # are vectorised by ``omp simd`` (-fopenmp-simd, no OpenMP runtime).
    extra_compile_args=OPTIMISE if WINDOWS else [*OPTIMISE, "-fopenmp-simd"],
    extra_link_args=STRIP,
)

IFR_KERNEL = Extension(
    "attnflow._ifr_kernel",
    sources=["attnflow/_ifr_kernel.pyx"],
    depends=["attnflow/_ifr_kernel.h"],
    # Never -ffast-math (IFR subtracts two large norms); the sums over the hidden axis are
    # vectorised by ``omp simd`` (-fopenmp-simd, no OpenMP runtime).
    extra_compile_args=OPTIMISE if WINDOWS else [*OPTIMISE, "-fopenmp-simd"],
    extra_link_args=STRIP,
)

# The kernels are translated and compiled side by side (one per core): each wheel build and
# editable install of CI compiles all four, and one at a time took twice as long.
setup(
    ext_modules=cythonize(
        [KERNEL, GAE_KERNEL, CONTRIBUTIONS_KERNEL, IFR_KERNEL],
        language_level=3,
        nthreads=os.cpu_count() or 1,
    ),
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
