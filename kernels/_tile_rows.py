"""How the tiles order the dimensions of their rows, and the bfloat16 rounding they are fed.

The vdpbf16ps value tile's accumulator rows hold the dimensions in the order of its unpacks
(:func:`value_dim`); on AVX2 the bfloat16 FMA tiles keep query and accumulator rows in pair order
(:func:`pair_dim`, :func:`pair_position`; kernels/_tile_ir.py, PAIR_ORDER). The kernels write
their queries in that order and put each output row back in order once. The vdpbf16ps tiles take
the query and the probabilities rounded to bfloat16 (:func:`to_bf16`, :func:`pack_pairs`).
"""

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from pagekv.kernels._tile_ir import I32, LANES, PAIR_BLOCK, PAIRS


@intrinsic
def _f32_bits(typingctx, x):
    """The bit pattern of a float32, as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], I32)

    return types.uint32(types.float32), codegen


_JIT: dict[str, Any] = dict(cache=True, error_model="numpy", nogil=True)


@njit(inline="always", **_JIT)
def value_dim(j, head_dim):
    """The dimension d that position j of a bfloat16 value tile's accumulator row holds (the
    order of the unpacks of _interleave, kernels/_value_tiles.py): in each 32 positions,
    j = 16h + 4g + i holds d = 8g + 4h + i; in a last 16 (head_dim % 32 == 16), j = 8h + 4g + i
    holds the same d."""
    base, k = j - j % PAIRS, j % PAIRS
    half = LANES if base + PAIRS <= head_dim else LANES // 2
    return base + 8 * ((k % half) // 4) + 4 * (k // half) + k % 4


@njit(inline="always", **_JIT)
def pair_dim(j):
    """The dimension that position j of a row in pair order holds (PAIR_ORDER: the bfloat16 FMA
    tiles' queries and accumulators on AVX2): in each block of 16, positions 0-7 hold the even
    dimensions and 8-15 the odd, j = 16b + i holds 16b + 2i for i < 8, 16b + 2(i - 8) + 1 else."""
    base, i = j - j % PAIR_BLOCK, j % PAIR_BLOCK
    half = PAIR_BLOCK // 2
    return base + 2 * (i % half) + i // half


@njit(inline="always", **_JIT)
def pair_position(d):
    """The position of dimension d in a row in pair order (the inverse of :func:`pair_dim`)."""
    base, i = d - d % PAIR_BLOCK, d % PAIR_BLOCK
    return base + i // 2 + (i % 2) * (PAIR_BLOCK // 2)


@njit(inline="always", **_JIT)
def to_bf16(x):
    """bfloat16 bits of float32 x, rounded to nearest even (x finite)."""
    b = _f32_bits(x)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(**_JIT)
def pack_pairs(p, r0, num_rows, num_cols, packed):
    """Pack probabilities two tokens to a word for the value tiles: packed[r, j] holds p[r, 2j]
    (low 16 bits) and p[r, 2j + 1] (high 16 bits) rounded to bfloat16; a column past num_cols
    counts as 0.

    p : float32 [rows, >= num_cols]; packed : uint32 [rows, >= (num_cols + 1) // 2].
    """
    for r in range(r0, r0 + num_rows):
        for j in range(num_cols // 2):
            low, high = np.uint32(to_bf16(p[r, 2 * j])), np.uint32(to_bf16(p[r, 2 * j + 1]))
            packed[r, j] = low | (high << np.uint32(16))
        if num_cols % 2:
            packed[r, num_cols // 2] = np.uint32(to_bf16(p[r, num_cols - 1]))
