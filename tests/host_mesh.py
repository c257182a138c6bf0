"""Meshes of host CPU devices for the sharding tests, also where the default backend is a GPU."""

import math

import jax
import pytest


def host_mesh(shape, names, axis_types=None):
    """A mesh of ``prod(shape)`` host CPU devices (tests/conftest.py asks XLA for 8 of them)."""
    count = math.prod(shape)
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        pytest.fail(f"tests/conftest.py should give {count} CPU devices, got {len(cpus)}")
    kwargs = {} if axis_types is None else {"axis_types": (axis_types,) * len(shape)}
    return jax.make_mesh(shape, names, devices=cpus[:count], **kwargs)
