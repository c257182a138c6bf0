"""float32 bit patterns and hard division cases for the rounding tests."""

import numpy as np

TINY = np.finfo(np.float32).tiny


def f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def u32(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def near_midpoints(rng, n: int, exp_range: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """``x = RN(m * s)`` for float32 rounding midpoints ``m``: the hardest quotients
    ``x / s``, where the reciprocal rewrite ``x * (1 / s)`` is wrong about one time in three."""
    q = f32(rng.integers(0x3F000000, 0x40800000, n)) * np.exp2(
        rng.integers(-exp_range, exp_range, n)).astype(np.float32)
    s = f32(rng.integers(0x3F800000, 0x40000000, n)) * np.exp2(
        rng.integers(-exp_range, exp_range, n)).astype(np.float32)
    m = (q.astype(np.float64) + np.nextafter(q, np.float32(np.inf))) / 2
    x = (m * s).astype(np.float32) * rng.choice(np.float32([-1, 1]), n)
    return x, s
