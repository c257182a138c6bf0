"""Griffe extension: read the ``Example:`` sections of jaxquant's docstrings as examples.

jaxquant's docstrings use the singular ``Example:`` heading; griffe's Google-style parser
knows only ``Examples:`` and would otherwise render the doctest as plain markdown.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Renames ``Example:`` section headings to ``Examples:`` before parsing."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
