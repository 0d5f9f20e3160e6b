"""Run attnflow's docstring examples on array-api-strict (a pytest plugin).

The examples are written in NumPy, for readers. Loaded with ``-p array_api_doctests``, this
plugin runs every public function of attnflow that an example calls on array-api-strict
instead: each NumPy array an example passes in (also inside a list, tuple or dict) is handed
over as an ``array_api_strict`` array, and what comes back is checked to be array-api-strict
(a function must answer in the namespace it was given) and turned back into NumPy, so that
the example's printed output is compared as written. Functions that take a model (a Python
callable) keep NumPy: the model's namespace is the user's, not attnflow's. A
`FaithfulnessReport` is documented as NumPy (host statistics) and is left as it is.

At the end of the session the plugin reports how many calls ran on array-api-strict and
fails the session if none did, so that it cannot pass by running nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Generator
from typing import Any

import array_api_strict as xp
import numpy as np
import pytest
from _pytest.doctest import DoctestItem

# The modules whose public functions the examples reach: ``attnflow.rollout``,
# ``from attnflow.evaluate import blank_out``, ``from attnflow.plot import ...``.
PUBLIC_MODULES = [
    "attnflow",
    "attnflow.diagnosis",
    "attnflow.evaluate",
    "attnflow.explanation",
    "attnflow.html",
    "attnflow.plot",
]
# Classes built from arrays (views and explanations): what they keep is their own.
ARRAY_CLASSES = {"TokenView", "InteractiveView", "Explanation"}
# Model-facing functions: the model's inputs stay in its namespace; the scores to evaluate
# come from attnflow, from any backend.
SCORE_PARAMETERS = {"scores"}


StrictArray = type(xp.asarray(0.0))


@dataclasses.dataclass
class _Tally:
    calls: int = 0  # calls whose arrays went in as array-api-strict arrays
    items: set[str] = dataclasses.field(default_factory=set)  # examples with such a call
    collected: list[str] = dataclasses.field(default_factory=list)


TALLY = _Tally()


def _to_strict(value: Any) -> tuple[Any, bool]:
    """`value` with its NumPy arrays as array-api-strict arrays, and whether any was found."""
    if isinstance(value, np.ndarray):
        return xp.asarray(value), True
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        converted = [_to_strict(v) for v in value]
        if any(found for _, found in converted):
            return type(value)(v for v, _ in converted), True
    if isinstance(value, dict):
        pairs = {k: _to_strict(v) for k, v in value.items()}
        if any(found for _, found in pairs.values()):
            return {k: v for k, (v, _) in pairs.items()}, True
    return value, False


def _to_numpy(value: Any, where: str, *, numpy_allowed: bool = False) -> Any:
    """`value` with its array-api-strict arrays as NumPy arrays.

    A NumPy array in it is an error unless `numpy_allowed` (a model's answer is in the
    model's namespace).
    """
    if isinstance(value, StrictArray):
        return np.from_dlpack(value)
    if isinstance(value, HOST_RESULTS):
        return value
    if isinstance(value, np.ndarray) and numpy_allowed:
        return value
    if isinstance(value, np.ndarray):
        msg = f"{where} was given array-api-strict arrays and answered with a NumPy array"
        raise TypeError(msg)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return type(value)._make(_to_numpy(v, where, numpy_allowed=numpy_allowed) for v in value)
    if isinstance(value, list | tuple):
        return type(value)(_to_numpy(v, where, numpy_allowed=numpy_allowed) for v in value)
    if isinstance(value, dict):
        return {k: _to_numpy(v, where, numpy_allowed=numpy_allowed) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for field in dataclasses.fields(value):
            if not field.init:
                continue
            before = getattr(value, field.name)
            after = _to_numpy(before, f"{where}.{field.name}", numpy_allowed=numpy_allowed)
            if after is not before:
                changed[field.name] = after
        return dataclasses.replace(value, **changed) if changed else value
    return value


def _takes_a_model(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    # A model is a Python callable (a function, a partial, a module with __call__); callable
    # options such as heads= are functions on arrays, which attnflow calls on its own arrays.
    names = inspect.signature(function).parameters
    first = next(iter(names), None)
    return first in {"predict", "model", "functions"} or any(
        isinstance(v, ModelFunctionsType) for v in (*args, *kwargs.values())
    )


ModelFunctionsType: type = importlib.import_module("attnflow.evaluate").ModelFunctions
# Documented as host results (NumPy statistics of a whole evaluation, saved to disk).
HOST_RESULTS: tuple[type, ...] = (importlib.import_module("attnflow.evaluate").FaithfulnessReport,)


def _on_strict(function: Callable[..., Any], name: str, item: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        takes_a_model = _takes_a_model(function, args, kwargs)
        if takes_a_model:
            bound = inspect.signature(function).bind(*args, **kwargs)
            found = False
            for key in SCORE_PARAMETERS & bound.arguments.keys():
                bound.arguments[key], converted = _to_strict(bound.arguments[key])
                found = found or converted
            if not found:
                return function(*args, **kwargs)
            strict_args, strict_kwargs = bound.args, bound.kwargs
        else:
            strict_args, found = _to_strict(args)
            strict_kwargs, found_kw = _to_strict(kwargs)
            if not (found or found_kw):
                return function(*args, **kwargs)
        TALLY.calls += 1
        TALLY.items.add(item)
        return _to_numpy(function(*strict_args, **strict_kwargs), name, numpy_allowed=takes_a_model)

    return run


def _init_on_strict(cls: type, item: str) -> Callable[..., None]:
    """`cls.__init__`, given array-api-strict arrays for the example's NumPy arrays."""
    init = cls.__init__

    @functools.wraps(init)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        strict_args, found = _to_strict(args)
        strict_kwargs, found_kw = _to_strict(kwargs)
        if found or found_kw:
            TALLY.calls += 1
            TALLY.items.add(item)
        init(self, *strict_args, **strict_kwargs)

    return run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    if not isinstance(item, DoctestItem):
        return (yield)
    with pytest.MonkeyPatch.context() as patch:
        for module_name in PUBLIC_MODULES:
            module = importlib.import_module(module_name)
            for name in getattr(module, "__all__", []):
                value = getattr(module, name)
                if name in ARRAY_CLASSES:
                    patch.setattr(value, "__init__", _init_on_strict(value, item.name))
                elif inspect.isfunction(value):
                    wrapped = _on_strict(value, f"{module_name}.{name}", item.name)
                    patch.setattr(module, name, wrapped)
        return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    TALLY.collected = [item.name for item in items if isinstance(item, DoctestItem)]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"array-api-strict doctests: {TALLY.calls} attnflow calls in "
        f"{len(TALLY.items)} of {len(TALLY.collected)} examples ran on array-api-strict arrays"
    )
    others = sorted(set(TALLY.collected) - TALLY.items)
    if others:
        # Examples of models, files, classes and the CLI: they ran as written, in NumPy.
        terminalreporter.write_line("ran with NumPy only: " + ", ".join(others))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0 and TALLY.calls == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
