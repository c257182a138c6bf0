"""A few steps of Adam on an nnx model under ``nnx.jit``, shared by the nnx tests."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def train_nnx(model: nnx.Module, x, y, steps: int = 25) -> list[float]:
    """Trains ``model`` in place on the mean squared error to ``y``; returns the losses."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes python floats and int32
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]


class SharedKernel(nnx.Module):
    """Two Linear layers holding one kernel Variable (weight sharing, ALBERT-like)."""

    def __init__(self):
        self.a = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
        self.b.kernel = self.a.kernel

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))
