"""Test configuration: strict dtype promotion and 8 host devices for sharding tests."""

import os

from xla_env import COMPILE_FAST

# 8 host devices, and compiling without LLVM's expensive passes (see `xla_env`); a flag the
# caller's XLA_FLAGS already sets is left as it is.
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_given] + [f for f in ("--xla_force_host_platform_device_count=8", *COMPILE_FAST)
                if f.split("=")[0] not in _given]).strip()

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
