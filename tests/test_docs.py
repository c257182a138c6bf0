"""Documentation coverage: every public name has a docstring and a place in the API pages.

The public names are those of ``jaxquant.__all__``, of every public submodule listed there
(``jaxquant.calibration``) and of the optional subpackages in `OPTIONAL_NAMESPACES` when they
exist. A name is documented by a mkdocstrings directive ``::: <namespace>.<name>`` (for
example ``::: jaxquant.quantize`` or ``::: jaxquant.calibration.minmax``) on a line of its
own in some ``docs/**/*.md``. These checks parse the markdown and need no mkdocs; the last
test of that part builds the site with ``mkdocs build --strict`` when mkdocs is installed.

The tests after it hold README.md and ARCHITECTURE.md to the code: the set-up commands against
pyproject.toml and ``.ci/run``, the module lists against the package's files, the command line
example and options against ``jaxquant quantize``, the checkpoint format against its header.
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


# --- README.md and ARCHITECTURE.md against the code ----------------------------------------
# The README's Python examples are doctests, run by pytest itself (``--doctest-glob=README.md``
# in pyproject.toml); the tests below check the rest of what the two files say: the set-up
# commands, the module lists, the command line example and the checkpoint format's header.

README = (ROOT / "README.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "jaxquant"


def _section(text: str, heading: str) -> str:
    """The body of the markdown section ``## heading`` (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def _modules() -> set[str]:
    """``jaxquant``'s Python files, relative to the package (``_tree.py``, ``flax/nnx.py``)."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def test_readme_examples_are_doctests():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pytest_config = config["tool"]["pytest"]["ini_options"]
    assert "README.md" in pytest_config["testpaths"]
    assert "--doctest-glob=README.md" in pytest_config["addopts"].split()
    assert README.count("```python\n>>> ") >= 5  # the examples are doctests, not plain code


def test_readme_setup_commands_match_pyproject_and_ci():
    """The README opens with two commands, an install + demo and an install + the tests, that
    name existing extras, and the second is the one `.ci/run` executes."""
    import tomllib

    first_block = re.search(r"```bash\n(.*?)```", README, re.DOTALL)
    assert first_block and README.index(first_block.group(0)) < README.index("\n## ")
    lines = first_block.group(1).strip().splitlines()
    assert len(lines) == 2, lines
    demo, test = lines
    assert re.fullmatch(r"python3 -m venv \.venv && \.venv/bin/pip install \. && "
                        r"\.venv/bin/jaxquant demo", demo), demo
    assert re.fullmatch(r"python3 -m venv \.venv && \.venv/bin/pip install '\.\[test\]' && "
                        r"\.venv/bin/python -m pytest( .*)?", test), test
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "test" in config["project"]["optional-dependencies"]
    assert config["project"]["scripts"]["jaxquant"] == "jaxquant._cli:main"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_pattern = re.search(r"grep -m1 -E '([^']+)' README\.md", ci).group(1)
    assert [ln for ln in README.splitlines() if re.search(ci_pattern, ln)][0] == test


def test_readme_requirements_are_the_pyproject_floors():
    """The README's "Requirements" paragraph gives each package's floor as pyproject.toml
    does (and no other), so that the floors the suite was run at are the ones pip enforces."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    floors = {}
    for spec in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        m = re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?>=([\d.]+)", spec)
        if m:
            assert floors.setdefault(m.group(1), m.group(2)) == m.group(2), spec  # one floor
    paragraph = re.search(r"\nRequirements: (.*?)\n\n", README, re.DOTALL).group(1)
    paragraph = " ".join(paragraph.split())
    named = {"jax": "jax and jaxlib", "jaxlib": "jax and jaxlib", "ml_dtypes": "ml_dtypes",
             "flax": "flax", "safetensors": "safetensors"}
    for package, words in named.items():
        assert f"{words} {floors[package]} or later" in paragraph, (package, floors[package])
    assert f"numpy {floors['numpy'].removesuffix('.0')}" in paragraph, floors["numpy"]
    assert f"Python {project['requires-python'].removeprefix('>=')} or later" in paragraph


def test_readme_extras_exist():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["optional-dependencies"]
    named = set()
    for spec in re.findall(r"pip install '(?:\.|jaxquant)\[([\w,]+)\]'", README):
        named.update(spec.split(","))
    assert named >= {"test", "io", "docs", "notebooks", "minilm"}, named
    assert named <= set(extras), sorted(named - set(extras))


def test_architecture_module_table_lists_every_module():
    """Every file of the package has a row in ARCHITECTURE.md's module table, and every row
    names a file that exists."""
    rows = re.findall(r"^\| (`[^|]*`) \|", ARCHITECTURE, re.MULTILINE)
    listed = {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row)}
    assert listed, "no module table in ARCHITECTURE.md"
    missing, stale = _modules() - listed, listed - _modules()
    assert not missing, f"modules without a row in ARCHITECTURE.md: {sorted(missing)}"
    assert not stale, f"ARCHITECTURE.md rows for modules that do not exist: {sorted(stale)}"


def test_readme_layout_names_every_core_module():
    layout = _section(README, "Layout")
    named = set(re.findall(r"`(_\w+|__main__)`", layout))
    core = {Path(m).stem for m in _modules() if "/" not in m} - {"__init__", "calibration"}
    assert not core - named, f"modules missing from README's Layout: {sorted(core - named)}"
    assert not named - core, f"README's Layout names no such module: {sorted(named - core)}"
    assert "jaxquant/calibration.py" in layout and "jaxquant/flax/" in layout


def test_demo_format_count_in_readme():
    from jaxquant._demo import CONFIGS

    words = {"twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16}
    match = re.search(r"to (\w+) format/granularity combinations", README)
    assert match, "the README no longer says how many formats the demo runs"
    quantized = sum(spec is not None for *_, spec in CONFIGS)
    assert words[match.group(1)] == quantized, f"the demo runs {quantized} combinations"


def test_readme_cli_options_are_the_command_lines():
    """The SPEC options the README lists are those of ``jaxquant quantize --help``, and its
    example command runs: the rules select what the README says they do."""
    pytest.importorskip("safetensors")
    import shlex
    import tempfile

    import numpy as np
    from safetensors.numpy import save_file

    import jaxquant as jq
    from jaxquant._cli import _HELP, main
    from jaxquant._cli_rules import parse_rule

    section = _section(README, "Command line")
    options = set(re.findall(r"`:(\w+)", section))
    in_help = set(re.findall(r'\| "(\w+)', _HELP)) | set(re.findall(r'OPTION := "(\w+)', _HELP))
    assert options == in_help, (sorted(options), sorted(in_help))

    command = re.search(r"^jaxquant quantize .*$", section, re.MULTILINE).group(0)
    argv = shlex.split(command)[1:]
    rules = dict(parse_rule(r) for r in argv[argv.index("--rules") + 1:])
    assert rules["bias$"] is None
    assert rules["c_fc"].packed and rules["c_fc"].block_size == 32 and rules["weight"].axis == 0

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        src, dst = f"{d}/model.safetensors", f"{d}/model-q.safetensors"
        save_file({"h.0.mlp.c_fc.weight": rng.standard_normal((64, 32), np.float32),
                   "h.0.mlp.c_fc.bias": np.zeros(32, np.float32),
                   "h.0.attn.c_proj.weight": rng.standard_normal((32, 32), np.float32)}, src)
        argv = [a if a != "model.safetensors" else src for a in argv]
        argv = [a if a != "model-q.safetensors" else dst for a in argv]
        assert main([*argv, "--quiet"]) == 0
        q = jq.load_safetensors(dst)
        assert main(["report", src, dst]) == 0
    fc = q["h.0.mlp.c_fc.weight"]
    assert jq.is_qtensor(fc) and fc.packed and fc.block_size == 32 and fc.axis == 0
    assert q["h.0.attn.c_proj.weight"].axis == 0
    assert not jq.is_qtensor(q["h.0.mlp.c_fc.bias"])


def test_readme_checkpoint_format_matches_the_header():
    import numpy as np

    from jaxquant import _serialization as ser

    fmt = README[README.index("**Checkpoint format"):README.index("## Calibration")]
    version = int(re.search(r"Checkpoint format \(version (\d+)", fmt).group(1))
    assert version == ser.FORMAT_VERSION, f"the README documents version {version}, files are "\
        f"written as version {ser.FORMAT_VERSION}"
    assert f'"version": {version}' in fmt and f'"format": "{ser.FORMAT_NAME}"' in fmt
    assert all(v in ser._READABLE for v in (1, version)) and "version-1 files still load" in fmt
    assert f'__metadata__["{ser.HEADER_KEY}"]' in fmt
    assert f'__metadata__["{ser.HEADER_CRC_KEY}"]' in fmt
    for field in (*ser._QTENSOR_FIELDS, "codebook", "scale"):
        assert f"`{field}`" in fmt, field
    for kind in ("array", "packed", "qtensor"):
        assert f'"{kind}"' in fmt and kind in ser._KINDS
    header, _ = ser.encode({"a": np.ones(3, np.float32)}, to_host=True)
    assert set(header) == {"format", "version", "leaves", "tensors"}
    assert set(header["tensors"]["a"]) == {"dtype", "shape", "encoding", "crc32"}
    for encoding in ("raw", "packed", "bitcast"):  # every encoding `storage` reads is named
        assert f'"{encoding}"' in fmt
    assert ser.ST_CODES["float8_e8m0fnu"] in fmt
