"""Checks shared by the command-line tests."""

import re


def one_error(capsys, command: str, pattern: str) -> None:
    """stdout empty, stderr one line ``jaxquant COMMAND: error: ...`` matching ``pattern``."""
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"jaxquant {command}: error: ") and re.search(pattern, err), err
