"""Test configuration: strict dtype promotion and 8 host devices for sharding tests."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Float references are exact float32 dots: on GPU the default float32 matmul
# precision is TF32 (10-bit mantissa), which alone moves results by ~1e-3.
jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="class")
def small_chunks():
    """Streams weight-only dots in chunks of at most 8 KiB of float32 (many chunks), for a
    whole test class: the jit caches are cleared on entry and on exit (no program compiled
    with another chunk size is reused), not around every test."""
    from jaxquant import _weight_only

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_weight_only, "STREAM_BYTES", 8192)
        jax.clear_caches()
        yield
    jax.clear_caches()
