"""Helpers for tests that inspect traced programs."""

import jax
import jax.extend.core
import jax.numpy as jnp


def find_eqns(jaxpr, name: str = "dot_general"):
    """Every ``name`` equation of ``jaxpr``, in nested jaxprs (pjit, cond, scan bodies) too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from find_eqns(sub, name)


def integer_convolution(jaxpr):
    """The one int8 x int8 convolution of ``jaxpr``. Any other convolution must be the CUDA
    and ROCm branch of `jaxquant._barriers.int_conv` (cuDNN has no int32 convolution), which
    sums the same codes in float32 convolutions."""
    convs = list(find_eqns(jaxpr, "conv_general_dilated"))
    dtypes = [[v.aval.dtype for v in c.invars] for c in convs]
    ints = [c for c, d in zip(convs, dtypes, strict=True) if d == [jnp.int8, jnp.int8]]
    assert len(ints) == 1, dtypes
    assert all(d == [jnp.float32, jnp.float32] for c, d in zip(convs, dtypes, strict=True)
               if c is not ints[0]), dtypes
    return ints[0]


def lowered_text(fn, *args, platform: str) -> str:
    """The StableHLO text of ``jax.jit(fn)`` on ``args``, lowered for ``platform``
    (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``), which need not be present."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
