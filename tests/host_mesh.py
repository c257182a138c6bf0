"""Meshes of host CPU devices for the sharding tests, also where the default backend is a GPU."""

import math

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxquant as jq


def host_mesh(shape, names, axis_types=None):
    """A mesh of ``prod(shape)`` host CPU devices (tests/conftest.py asks XLA for 8 of them)."""
    count = math.prod(shape)
    cpus = jax.devices("cpu")
    if len(cpus) < count:
        pytest.fail(f"tests/conftest.py should give {count} CPU devices, got {len(cpus)}")
    kwargs = {} if axis_types is None else {"axis_types": (axis_types,) * len(shape)}
    return jax.make_mesh(shape, names, devices=cpus[:count], **kwargs)


def cpu_normal(*shape, seed=0):
    """Random normal float32 on the first CPU device (where the one-device references run)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jax.device_put(x, jax.devices("cpu")[0])


def spec_of(a) -> P:
    """The PartitionSpec of an array (or a PackedArray's bytes), trailing Nones dropped."""
    a = a.data if isinstance(a, jq.PackedArray) else a
    parts = list(a.sharding.spec)
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)
