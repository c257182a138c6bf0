"""XLA flags of the test processes, and the environment of subprocesses that run real work."""

import os

# The suite is bound by XLA:CPU compile time (thousands of small programs): LLVM's expensive
# optimizations are skipped. They change neither the HLO programs nor their IEEE arithmetic,
# only how fast the machine code runs.
COMPILE_FAST = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def full_speed_env(**extra: str) -> dict:
    """``os.environ`` for a subprocess that runs real work (the CLI demo, a benchmark, a
    notebook's kernel): its run time, not its compile time, dominates, so without
    `COMPILE_FAST`; ``extra`` variables added.

    Example:
      >>> "--xla_backend_optimization_level=0" in full_speed_env()["XLA_FLAGS"]
      False
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in COMPILE_FAST]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), **extra}
