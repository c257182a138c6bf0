"""Executes every ``notebooks/*.ipynb`` and fails on any cell error.

A notebook that needs an optional package says so in its metadata,
``metadata.jaxquant.requires = ["flax", ...]`` (importable module names); it is skipped,
as `pytest.importorskip` would, when one of them is missing. Each notebook runs in a
fresh kernel of this Python interpreter, in a temporary working directory, with
``JAXQUANT_SMOKE_TEST=1``: a notebook that trains for long may then train for a few
steps only (the committed outputs are those of the full run, `test_committed_notebook_is_executed`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from xla_env import full_speed_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell: generous for a loaded 2-core machine; each notebook takes ~15-30 s


def _requires(nb) -> list[str]:
    requires = nb.metadata.get("jaxquant", {}).get("requires", [])
    if not (isinstance(requires, list) and all(isinstance(r, str) for r in requires)):
        raise TypeError(f"metadata.jaxquant.requires must be a list of module names, got "
                        f"{requires!r}")
    return requires


def test_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"01_quickstart.ipynb", "03_convert_checkpoint.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_executed(path):
    """The committed notebook carries the outputs of a full run, in order, without errors."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{path.name} was not executed top to bottom in one run: run python notebooks/_build.py")
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} holds an error output: {errors[0].get('ename')}"
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), (
        f"{path.name} has no plot")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    for module in _requires(nb):
        pytest.importorskip(module)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute(env=full_speed_env(JAXQUANT_SMOKE_TEST="1"))  # not compile-bound
    except nbclient.exceptions.CellExecutionError as e:
        message = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the traceback is ANSI-coloured
        pytest.fail(f"{path.name}: {message}", pytrace=False)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert list(tmp_path.iterdir()) == [], "a notebook left files in its working directory"
