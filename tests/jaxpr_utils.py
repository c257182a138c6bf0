"""Helpers for tests that inspect traced programs."""

import jax
import jax.extend.core


def find_eqns(jaxpr, name: str = "dot_general"):
    """Every ``name`` equation of ``jaxpr``, in nested jaxprs (pjit, cond, scan bodies) too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from find_eqns(sub, name)


def lowered_text(fn, *args, platform: str) -> str:
    """The StableHLO text of ``jax.jit(fn)`` on ``args``, lowered for ``platform``
    (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), which need not be present."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
