"""What an evaluation folder records of the functions that made its numbers.

A resumed evaluation must be the same evaluation: the same model and, under each method
name, the same function with the same options. :func:`describe_function` writes a
function down as text that is stable across processes and tells such functions apart:

* a named module-level function (``attnflow.rollout``, ``mypackage.scores``) by its
  importable name, ``module.qualname``;
* a lambda or a nested function by its name and a digest of its code, its default
  values and the values it captured (its closure), since many share one name;
* a :func:`functools.partial` by its function and its arguments, written out;
* a bound method by its function and its object's class; another callable object by
  its class and, where it has no memory address in it, its ``repr``.

Arrays among the values are written as their shape, dtype and a SHA-256 of their bytes.

:func:`identify_functions` goes further, for a model given as plain functions without an
identity: it digests everything that decides their results (code, defaults, captured
values and the module-level values their code reads) and gives up (None) where one of
them is an object whose state it cannot read (a framework's module, a bound method),
rather than name two models alike.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["describe_function", "describe_value", "identify_functions"]

_DEPTH = 6  # nested partials and containers deeper than this are cut short


def describe_function(function: Callable[..., Any], depth: int = 0) -> str:
    """Return a stable text that names `function` and the options it carries.

    Parameters
    ----------
    function : callable
        A method of an evaluation (or any callable).

    Returns
    -------
    str
        E.g. ``"attnflow._rollout.rollout(residual=0.3)"`` for
        ``functools.partial(attnflow.rollout, residual=0.3)``.

    Examples
    --------
    >>> import functools
    >>> import attnflow
    >>> from attnflow.evaluate._identity import describe_function
    >>> describe_function(functools.partial(attnflow.rollout, residual=0.3))
    'attnflow._rollout.rollout(residual=0.3)'
    >>> describe_function(lambda a, **k: a).split(".")[-1][:14]
    '<lambda> [code'
    """
    if depth > _DEPTH:
        return "..."
    if isinstance(function, functools.partial):
        arguments = [describe_value(value, depth + 1) for value in function.args]
        arguments += [
            f"{key}={describe_value(value, depth + 1)}"
            for key, value in sorted(function.keywords.items())
        ]
        return f"{describe_function(function.func, depth + 1)}({', '.join(arguments)})"
    if isinstance(function, types.MethodType):
        owner = type(function.__self__)
        return f"{describe_function(function.__func__, depth + 1)} of a {_name(owner)}"
    if isinstance(function, types.FunctionType):
        name = _name(function)
        if "<" in function.__qualname__:  # a lambda or a local function: names are shared
            return f"{name} [code {_code_digest(function, depth)}]"
        return name
    if isinstance(function, type | types.BuiltinFunctionType):
        return _name(function)
    text = repr(function)
    kind = _name(type(function))
    if " at 0x" in text or len(text) > 200:
        return f"a {kind} object"
    return f"a {kind} object {text}"


def describe_value(value: object, depth: int = 0) -> str:
    """Return a stable text for an option's value (numbers, strings, arrays, functions)."""
    if depth > _DEPTH:
        return "..."
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list):
        inner = ", ".join(describe_value(item, depth + 1) for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, frozenset | set):
        return "{" + ", ".join(sorted(describe_value(item, depth + 1) for item in value)) + "}"
    if isinstance(value, Mapping):
        items = sorted(
            f"{describe_value(key, depth + 1)}: {describe_value(item, depth + 1)}"
            for key, item in value.items()
        )
        return "{" + ", ".join(items) + "}"
    if isinstance(value, np.generic):
        return repr(value.item())
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return _describe_array(value)
    if callable(value):
        return describe_function(value, depth + 1)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    text = repr(value)
    if " at 0x" in text or len(text) > 200:
        return f"a {_name(type(value))} object"
    return text


def _describe_array(value: Any) -> str:
    try:
        host = np.asarray(value)
    except Exception:  # noqa: BLE001 - any library's array that numpy cannot read
        return f"a {_name(type(value))} of shape {tuple(value.shape)}"
    digest = hashlib.sha256(f"{host.dtype.str}{host.shape};".encode())
    digest.update(np.ascontiguousarray(host).tobytes())
    return f"array{tuple(host.shape)} {host.dtype} sha256:{digest.hexdigest()[:16]}"


def _name(thing: Any) -> str:
    module = getattr(thing, "__module__", None) or "?"
    return f"{module}.{getattr(thing, '__qualname__', getattr(thing, '__name__', '?'))}"


def _code_digest(function: types.FunctionType, depth: int) -> str:
    """Digest of what decides a local function's result: code, defaults, closure."""
    digest = hashlib.sha256()
    _update_code(digest, function.__code__)
    digest.update(describe_value(function.__defaults__, depth + 1).encode())
    digest.update(describe_value(function.__kwdefaults__, depth + 1).encode())
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or (), strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            content = None
        digest.update(f"{name}={describe_value(content, depth + 1)};".encode())
    return digest.hexdigest()[:16]


def _update_code(digest: Any, code: types.CodeType) -> None:
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            _update_code(digest, constant)
        else:
            digest.update(describe_value(constant).encode())


def identify_functions(*functions: Callable[..., Any] | None) -> str | None:
    """Return a digest of everything that decides the results of `functions`, or None.

    Two sets of functions get the same digest only if their code, default values,
    captured values (closures, :func:`functools.partial` arguments) and the module-level
    values their code reads are equal: a factory that returns closures over different
    weights gives different digests. Values are read by content (numbers, strings,
    containers, arrays that NumPy can read), modules, classes and other packages'
    functions by their importable names. Anything else (an object with its own state,
    such as a framework's module, or a bound method) cannot be read: the result is None.

    Parameters
    ----------
    *functions : callable or None
        The functions (None entries are recorded as absent).

    Returns
    -------
    str or None
        ``"sha256:<hex>"``, or None when the functions cannot be told apart by content.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate._identity import identify_functions
    >>> def factory(weights):
    ...     return lambda ids: weights[ids]
    >>> a, b = factory(np.zeros(3)), factory(np.ones(3))
    >>> identify_functions(a) == identify_functions(factory(np.zeros(3)))
    True
    >>> identify_functions(a) == identify_functions(b)
    False
    """
    parts = []
    for function in functions:
        text = "None" if function is None else _by_content(function, 0, set(), None)
        if text is None:
            return None
        parts.append(text)
    return "sha256:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _by_content(value: object, depth: int, seen: set[int], home: str | None) -> str | None:
    """Describe `value` by what decides its behaviour, or None where that is unreadable.

    `home`: the module whose functions are read through (code and globals); functions
    of other modules are named, as a library's are.
    """
    if depth > _DEPTH:
        return None
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return repr(value)
    if isinstance(value, tuple | list | frozenset | set):
        items = [_by_content(item, depth + 1, seen, home) for item in value]
        if any(item is None for item in items):
            return None
        texts = [str(item) for item in items]
        if isinstance(value, frozenset | set):
            texts.sort()
        return f"{type(value).__name__}({', '.join(texts)})"
    if isinstance(value, Mapping):
        pairs = []
        for key, item in value.items():
            key_text = _by_content(key, depth + 1, seen, home)
            item_text = _by_content(item, depth + 1, seen, home)
            if key_text is None or item_text is None:
                return None
            pairs.append(f"{key_text}: {item_text}")
        return "{" + ", ".join(sorted(pairs)) + "}"
    if isinstance(value, np.generic):
        return repr(value.item())
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type | types.BuiltinFunctionType):
        return _name(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            host = np.asarray(value)
        except Exception:  # noqa: BLE001 - an array NumPy cannot read (e.g. one that needs grad)
            return None
        return _describe_array(host) if host.dtype != object else None
    if isinstance(value, functools.partial):
        inner = [value.func, value.args, dict(value.keywords)]
        described = [_by_content(item, depth + 1, seen, home) for item in inner]
        if any(text is None for text in described):
            return None
        return f"partial({', '.join(map(str, described))})"
    if isinstance(value, types.FunctionType):
        return _function_by_content(value, depth, seen, home)
    return None  # an object whose state is its own (bound methods included)


def _function_by_content(
    function: types.FunctionType, depth: int, seen: set[int], home: str | None
) -> str | None:
    name = _name(function)
    module = function.__module__
    if home is not None and module != home and "<" not in function.__qualname__:
        return name  # another package's function: named, as describe_function does
    if id(function) in seen:
        return name  # recursion: read once
    seen.add(id(function))
    digest = hashlib.sha256(name.encode())
    _update_code(digest, function.__code__)
    inner = [function.__defaults__, function.__kwdefaults__]
    cells = function.__closure__ or ()
    for variable, cell in zip(function.__code__.co_freevars, cells, strict=False):
        try:
            inner.append((variable, cell.cell_contents))
        except ValueError:  # an empty cell
            inner.append((variable, None))
    namespace = function.__globals__
    inner += [(n, namespace[n]) for n in sorted(_global_names(function.__code__)) if n in namespace]
    for item in inner:
        text = _by_content(item, depth + 1, seen, module)
        if text is None:
            return None
        digest.update(text.encode() + b";")
    return f"{name} [code {digest.hexdigest()[:16]}]"


def _global_names(code: types.CodeType) -> set[str]:
    """Return the names a code object (and the code nested in it) may read as globals."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names
