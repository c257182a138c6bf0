"""`qeinsum`: two-operand einsum on `QTensor` operands, as a `qdot_general`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from jaxquant._args import as_array
from jaxquant._dot import ActQuant, qdot_general
from jaxquant._qtensor import is_qtensor

__all__ = ["qeinsum"]

_is_q = is_qtensor


def qeinsum(subscripts: str, lhs, rhs, *, precision=None,
            preferred_element_type: DTypeLike | None = None,
            act_quant: ActQuant | None = None, out_sharding=None) -> jax.Array:
    """Two-operand ``jnp.einsum`` through `qdot_general`: either operand may be a `QTensor`.

    Letters in both operands are contracted (absent from the output) or batch
    dimensions (present); the other letters must appear in the output.

    Args:
      subscripts: ``"ab,bc->ac"``; without ``->`` the output is the letters
        that occur once, sorted (as NumPy). Whitespace is ignored. No ellipsis,
        no letter repeated within an operand, no letter of one operand summed
        out, no broadcasting of size-1 dimensions.
      lhs: a float array or a `QTensor`.
      rhs: a float array or a `QTensor`.
      precision: see `qdot_general`.
      preferred_element_type: see `qdot_general`.
      act_quant: see `qdot_general`.
      out_sharding: the output's sharding, a ``PartitionSpec`` or ``NamedSharding`` in the
        output letters' order (as ``jnp.einsum``'s): needed on a mesh with explicit axes
        when a contracted letter is sharded (a row-parallel weight).

    Returns:
      The einsum, its axes in the output letters' order.

    Raises:
      TypeError: ``subscripts`` not a string; an operand that is not an array or a
        `QTensor` (``None``, a string); ``out_sharding`` not a ``PartitionSpec`` or
        ``NamedSharding``.
      ValueError: subscripts outside this two-operand form (named: the letter of
        one operand missing from the output, the output letter in neither
        operand), not matching the ranks, or a letter with different sizes in
        ``lhs`` and ``rhs``; an ``out_sharding`` with more entries than output letters.

    Example:
      >>> import jax.numpy as jnp, jaxquant as jq
      >>> w = jq.quantize(jnp.array([[1.0, -2.0], [0.5, 4.0]]), jnp.float32(0.5))
      >>> jq.qeinsum("ij,bi->bj", w, jnp.array([[1.0, 3.0]]))
      Array([[ 2.5, 10. ]], dtype=float32)
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"subscripts must be a str like 'ab,bc->ac', got "
                        f"{type(subscripts).__name__}.")
    # whitespace is ignored anywhere, as by jnp.einsum
    m = re.fullmatch(r"([a-zA-Z]*),([a-zA-Z]*)(?:->([a-zA-Z]*))?", "".join(subscripts.split()))
    if m is None:
        raise ValueError(f"subscripts must look like 'ab,bc->ac' (two operands, letters only, "
                         f"no ellipsis), got {subscripts!r}.")
    a, b, out = m.groups()
    lhs, rhs = (op if _is_q(op) else as_array(op, name)
                for name, op in (("lhs", lhs), ("rhs", rhs)))
    if out is None:
        out = "".join(sorted(c for c in set(a + b) if (a + b).count(c) == 1))
    for name, s, op in (("lhs", a, lhs), ("rhs", b, rhs), ("output", out, None)):
        if len(set(s)) != len(s):
            raise ValueError(f"{name} subscripts {s!r} repeat a letter; not supported.")
        ndim = None if name == "output" else op.ndim
        if ndim is not None and len(s) != ndim:
            raise ValueError(f"{name} subscripts {s!r} name {len(s)} axes, but {name} has rank "
                             f"{ndim}.")
    for name, s, other in (("lhs", a, b), ("rhs", b, a)):
        summed = [c for c in s if c not in other and c not in out]
        if summed:
            raise ValueError(f"in {subscripts!r}, {summed[0]!r} occurs in {name} only and is "
                             f"not in the output; a letter of one operand must be in the "
                             f"output (summing it out is not supported).")
    unknown = [c for c in out if c not in a + b]
    if unknown:
        raise ValueError(f"in {subscripts!r}, output letter {unknown[0]!r} occurs in neither "
                         f"operand.")
    shapes = [op.shape for op in (lhs, rhs)]
    for i, c in enumerate(a):
        if c in b and shapes[0][i] != shapes[1][b.index(c)]:
            raise ValueError(f"in {subscripts!r}, {c!r} has size {shapes[0][i]} in lhs but "
                             f"{shapes[1][b.index(c)]} in rhs.")
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    dims = ((tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
            (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)))
    order = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    y = qdot_general(lhs, rhs, dims, precision, preferred_element_type, act_quant=act_quant,
                     out_sharding=_in_dot_order(out_sharding, out, order))
    return jnp.transpose(y, tuple(order.index(c) for c in out))


def _in_dot_order(out_sharding, out: str, order: list[str]):
    """``out_sharding`` (in the letters ``out``'s order) in the dot's output order."""
    if out_sharding is None:
        return None
    spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"out_sharding must be a PartitionSpec or NamedSharding, got "
                        f"{type(out_sharding).__name__}.")
    if len(spec) > len(out):
        raise ValueError(f"out_sharding {spec} has {len(spec)} entries, but the output "
                         f"{out!r} has {len(out)} axes.")
    entries = tuple(spec) + (None,) * (len(out) - len(spec))
    spec = PartitionSpec(*(entries[out.index(c)] for c in order))
    return NamedSharding(out_sharding.mesh, spec) if isinstance(out_sharding, NamedSharding) \
        else spec
