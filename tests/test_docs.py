"""Documentation coverage: every public name has a docstring and a place in the API pages.

The public names are those of ``jaxquant.__all__``, of every public submodule listed there
(``jaxquant.calibration``) and of the optional subpackages in `OPTIONAL_NAMESPACES` when they
exist. A name is documented by a mkdocstrings directive ``::: <namespace>.<name>`` (for
example ``::: jaxquant.quantize`` or ``::: jaxquant.calibration.minmax``) on a line of its
own in some ``docs/**/*.md``. These checks parse the markdown and need no mkdocs; the last
test builds the site with ``mkdocs build --strict`` when mkdocs is installed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OPTIONAL_NAMESPACES = ("jaxquant.flax",)  # subpackages that need an optional dependency
DIRECTIVE = re.compile(r"^:::[ \t]+([\w.]+)[ \t]*$", re.MULTILINE)


def _directives() -> dict[str, list[str]]:
    """``{identifier: [pages that hold a ::: identifier directive]}``."""
    found: dict[str, list[str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for ident in DIRECTIVE.findall(page.read_text(encoding="utf-8")):
            found.setdefault(ident, []).append(str(page.relative_to(ROOT)))
    return found


def _namespace_names(module: types.ModuleType) -> list[str]:
    """Dotted public names of a module's ``__all__``, recursing into public submodules."""
    names = []
    for name in module.__all__:
        obj = getattr(module, name)
        qualified = f"{module.__name__}.{name}"
        names.append(qualified)
        if isinstance(obj, types.ModuleType) and hasattr(obj, "__all__"):
            names.extend(_namespace_names(obj))
    return names


def _attribute_docstring(module_name: str, name: str, depth: int = 0) -> str | None:
    """The string literal after ``name = ...`` in the module that defines ``name``.

    Follows ``from X import name`` re-exports, as griffe (mkdocstrings) does, so that data
    such as ``jaxquant.FORMATS`` is documented where it is assigned.
    """
    spec = importlib.util.find_spec(module_name)
    if depth > 8 or spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    body = ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body
    for stmt, nxt in zip(body, [*body[1:], None], strict=True):
        targets = (stmt.targets if isinstance(stmt, ast.Assign)
                   else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                return nxt.value.value
            return None
        if isinstance(stmt, ast.ImportFrom):
            source = importlib.util.resolve_name("." * stmt.level + (stmt.module or ""),
                                                 module_name if spec.submodule_search_locations
                                                 else module_name.rpartition(".")[0])
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return _attribute_docstring(source, alias.name, depth + 1)
    return None


def _docstring(qualified: str) -> str | None:
    """The docstring of a public name, ``None`` when it has none of its own."""
    module_name, _, name = qualified.rpartition(".")
    obj = getattr(importlib.import_module(module_name), name)
    if isinstance(obj, types.ModuleType | types.FunctionType | types.BuiltinFunctionType | type):
        doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
        # dataclasses and NamedTuples make up a "Name(field, ...)" docstring when none is given
        if doc and isinstance(obj, type) and re.match(rf"{re.escape(obj.__name__)}\(", doc):
            return None
        return inspect.cleandoc(doc) if doc and doc.strip() else None
    return _attribute_docstring(module_name, name)


def _namespaces() -> list:
    params = [pytest.param("jaxquant", id="jaxquant")]
    for ns in OPTIONAL_NAMESPACES:
        params.append(pytest.param(ns, id=ns))
    return params


def _load_namespace(namespace: str) -> types.ModuleType:
    if importlib.util.find_spec(namespace) is None:
        pytest.skip(f"{namespace} does not exist (yet)")
    try:
        return importlib.import_module(namespace)
    except ImportError as e:  # the subpackage exists but its optional dependency is missing
        pytest.importorskip(e.name or namespace)
        raise


@pytest.mark.parametrize("namespace", _namespaces())
def test_every_public_name_has_a_docstring(namespace):
    names = _namespace_names(_load_namespace(namespace))
    assert names, f"{namespace}.__all__ is empty"
    missing = [q for q in names if _docstring(q) is None]
    assert not missing, (
        "public names without a docstring of their own (give each one, with Args, Returns, "
        "Raises and an Example):\n  " + "\n  ".join(missing))


@pytest.mark.parametrize("namespace", _namespaces())
def test_every_public_name_has_an_api_page(namespace):
    names = _namespace_names(_load_namespace(namespace))
    documented = _directives()
    missing = [q for q in names if q not in documented]
    assert not missing, (
        f"{len(missing)} public names have no page in docs/; add these lines to a page under "
        f"docs/api/ (and the page to mkdocs.yml's nav if it is new):\n  "
        + "\n  ".join(f"::: {q}" for q in missing))


def test_every_directive_names_a_public_object():
    bad = []
    for ident, pages in _directives().items():
        module_name, _, name = ident.rpartition(".")
        if not ident.startswith("jaxquant") or any(p.startswith("_") for p in ident.split(".")):
            bad.append(f"{ident} ({', '.join(pages)}): not a public jaxquant path")
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            try:  # the directive names a module itself
                importlib.import_module(ident)
                continue
            except ImportError as e:
                bad.append(f"{ident} ({', '.join(pages)}): {e}")
                continue
        if not hasattr(module, name):
            bad.append(f"{ident} ({', '.join(pages)}): {module_name} has no {name!r}")
    assert not bad, "API pages name objects that do not exist:\n  " + "\n  ".join(bad)


def test_every_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    in_nav = set(re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?(\S+\.md)\s*$", config, re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), f"pages missing from mkdocs.yml nav: {sorted(pages - in_nav)}"
    assert in_nav - pages == set(), f"nav entries without a page: {sorted(in_nav - pages)}"


def test_coverage_check_reports_missing_names(tmp_path, monkeypatch):
    """The checks above do catch an undocumented name and an attribute without a docstring."""
    module = tmp_path / "jq_docs_probe.py"
    module.write_text('"""Probe."""\n__all__ = ["f", "X", "Y", "C"]\n'
                      'def f():\n    """Documented."""\n'
                      'X = 1\n"""X is documented."""\nY = 2\n'
                      'import dataclasses\n@dataclasses.dataclass\nclass C:\n    a: int = 0\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        names = _namespace_names(importlib.import_module("jq_docs_probe"))
        missing = [q for q in names if _docstring(q) is None]
        assert missing == ["jq_docs_probe.Y", "jq_docs_probe.C"]
        assert _docstring("jq_docs_probe.X") == "X is documented."
    finally:
        sys.modules.pop("jq_docs_probe", None)
    assert "jaxquant.quantize" in _directives()
    assert "jq_docs_probe.f" not in _directives()


def test_mkdocs_build_strict(tmp_path):
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material"):
        pytest.importorskip(module)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    html = (tmp_path / "site" / "api" / "core" / "index.html").read_text(encoding="utf-8")
    assert "jaxquant.quantize" in html and "Examples:" in html
