"""Progress bars for long operations: tqdm when it is installed and wanted, else nothing.

tqdm is optional (it comes with the ``io`` extra, ``pip install 'jaxquant[io]'``) and
imported only when a bar is asked for. Without it, or when the caller is quiet, a silent
stand-in with the same few methods takes its place, so that callers never branch.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["progress_bar"]


class _Silent:
    """A no-op stand-in for the part of ``tqdm`` that jaxquant uses."""

    def __init__(self, iterable: Iterable | None = None):
        self.iterable = iterable

    def __iter__(self) -> Iterator:
        return iter(self.iterable if self.iterable is not None else ())

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True,
                 total: int | None = None, desc: str | None = None,
                 unit: str = "it") -> Any:
    """A ``tqdm`` bar on stderr, or a silent stand-in when disabled or tqdm is missing.

    Args:
      iterable: what to iterate over (the bar advances by one per item); ``None``
        for a bar advanced by hand with ``update(n)``.
      enabled: ``False`` returns the silent stand-in without importing tqdm (as
        does a closed stderr, ``sys.stderr is None``).
      total: the number of steps (default: ``len(iterable)`` where it has one).
      desc: the label in front of the bar.
      unit: what one step is (``"tensor"``, ``"batch"``...).

    Raises:
      TypeError: ``enabled`` (a caller's ``progress`` argument) not a bool.

    Returns:
      A ``tqdm`` instance, or an object with the same ``__iter__``, ``update``,
      ``set_postfix_str``, ``close`` and context-manager methods that does nothing
      (and iterates over ``iterable`` unchanged).

    Example:
      >>> bar = progress_bar([1, 2, 3], enabled=False, desc="demo")
      >>> list(bar)
      [1, 2, 3]
      >>> bar.update(); bar.close()
    """
    if not isinstance(enabled, bool):  # progress="no" would draw a bar
        raise TypeError(f"progress must be a bool (True or False), got {enabled!r}.")
    if enabled and sys.stderr is not None:  # None: stderr closed (``2>&-``), nowhere to draw
        try:
            from tqdm import tqdm
        except ImportError:  # optional: without it, no bar
            pass
        else:
            return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr)
    return _Silent(iterable)
