"""GPT-J style (interleaved pairs) rotary embedding, with YaRN frequency scaling."""

from __future__ import annotations

import math

import numpy as np

from hybridkv.reference.config import YarnScaling


def yarn_correction_range(rope_dim: int, theta: float, yarn: YarnScaling) -> tuple[int, int]:
    """Pair indices ``(low, high)`` between which YaRN ramps from interpolated to original.

    Pair ``i`` with fewer than ``beta_slow`` rotations over the original context is
    fully interpolated (divided by ``factor``); more than ``beta_fast`` rotations, untouched.
    """

    def pair_index(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = math.floor(pair_index(yarn.beta_fast))
    high = math.ceil(pair_index(yarn.beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None = None) -> np.ndarray:
    """Angular frequency of each of the ``rope_dim // 2`` pairs (float64)."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even int, got {rope_dim}")
    if theta <= 1:
        raise ValueError(f"rope theta must be > 1, got {theta}")
    freqs = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if yarn is None:
        return freqs
    low, high = yarn_correction_range(rope_dim, theta, yarn)
    span = (high - low) if high != low else 0.001
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / span, 0.0, 1.0)
    keep = 1.0 - ramp  # 1 for fast (high-frequency) pairs: left as they are
    return freqs / yarn.factor * (1.0 - keep) + freqs * keep


def apply_rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, *, inverse: bool = False) -> np.ndarray:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of the last axis by ``position * freqs[i]``.

    ``x`` is ``[N, ..., rope_dim]`` and ``positions`` ``[N]``; ``inverse`` rotates back.
    Returns a new float64 array.
    """
    x = np.asarray(x, dtype=np.float64)
    positions = np.asarray(positions)
    if x.shape[-1] != 2 * freqs.shape[0]:
        raise ValueError(f"last axis {x.shape[-1]} != 2 * {freqs.shape[0]} frequencies")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"positions shape {positions.shape} must be ({x.shape[0]},)")
    angle = positions.astype(np.float64)[:, None] * freqs[None, :]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = np.cos(angle), np.sin(angle)
    if inverse:
        sin = -sin
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out
