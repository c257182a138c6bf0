"""Every public docstring example runs as pasted from the API docs: with empty globals.

pytest's ``--doctest-modules`` runs an example with the globals of its defining (private)
module, where ``quantize`` or ``jnp`` exist without an import; here each example of a public
name (of the ``__all__`` of `NAMESPACES`, the data's attribute docstrings and the module
docstrings included) starts from nothing, so it must import what it uses, by public names.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import importlib.util
import inspect
import types

import pytest
from test_docs import _attribute_docstring

NAMESPACES = ("jaxquant", "jaxquant.calibration", "jaxquant.flax", "jaxquant.flax.linen",
              "jaxquant.flax.nnx")
OPTIONAL = "jaxquant.flax"  # needs flax


def _namespace_tests(namespace: str) -> list[doctest.DocTest]:
    module = importlib.import_module(namespace)
    tests = doctest.DocTestFinder(recurse=False).find(module, namespace, module=False)
    finder = doctest.DocTestFinder()
    for name in module.__all__:
        obj, qualified = getattr(module, name), f"{namespace}.{name}"
        if isinstance(obj, types.ModuleType):
            continue  # a namespace of its own
        if inspect.isroutine(obj) or inspect.isclass(obj):
            tests += finder.find(obj, qualified, module=False)
        elif (doc := _attribute_docstring(namespace, name)) is not None:  # FORMATS, ...
            tests.append(doctest.DocTestParser().get_doctest(doc, {}, qualified, None, 0))
    return tests


@functools.cache
def _tests() -> dict[str, doctest.DocTest]:
    """``{name: DocTest}`` of every example, each docstring once (the first name it has)."""
    found, seen = {}, set()
    for namespace in NAMESPACES:
        if namespace.startswith(OPTIONAL) and importlib.util.find_spec("flax") is None:
            continue
        for test in _namespace_tests(namespace):
            if test.examples and test.docstring not in seen:
                seen.add(test.docstring)
                found[test.name] = test
    return found


def _names() -> list[str]:
    names = list(_tests())
    if importlib.util.find_spec("flax") is None:
        names.append(OPTIONAL)  # skipped by the test
    return names


@pytest.mark.parametrize("name", _names())
def test_example_runs_with_empty_globals(name):
    if name.startswith(OPTIONAL):
        pytest.importorskip("flax")
    found = _tests()[name]
    test = doctest.DocTest(found.examples, {}, found.name, found.filename, found.lineno,
                           found.docstring)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    result = runner.run(test, out=out.append)
    assert result.attempted and not result.failed, (
        f"{name}: {result.failed} of {result.attempted} examples fail with empty globals "
        "(import what the example uses, by public names):\n" + "".join(out))
