"""Narrow numbers to and from float32, compiled: one pass, no temporaries.

The attention kernels take float32 queries and write float32 outputs, so a float16 or bfloat16
query is widened before a kernel runs and its output rounded back after; keys and values written
into a cache of another dtype are rounded to it (float8 E4M3 too). NumPy did it in several
passes with temporaries (bfloat16 rounding alone: six array operations): for a 2,048-token prefill
of 8 heads x 64 that was 2.1 + 4.2 ms per layer call, a third of the attention kernel's own time,
against ~0.2 + 0.3 ms here.
"""

from llvmlite import ir  # type: ignore[import-untyped]
import math

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from pagekv.kernels._dtypes import (E4M3_NAN, FORMAT_BFLOAT16, bf16_bits_to_f32, e4m3_bits_to_f32,
                                    f16_bits_to_f32)

BFLOAT16_NAN = 0x7FC0  # the quiet NaN every float32 NaN rounds to (as torch's conversion does)


@intrinsic
def f32_to_f16_bits(typingctx, value):
    """float16 bit pattern of a float32, rounded to nearest even (IEEE: overflow to inf, NaN kept)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_to_bf16_bits(typingctx, value):
    """bfloat16 bit pattern of a float32, rounded to nearest even; every NaN becomes BFLOAT16_NAN."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(bits, i32(16)), i32(1))
        rounded = builder.lshr(builder.add(bits, builder.add(i32(0x7FFF), odd)), i32(16))
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(is_nan, ir.IntType(16)(BFLOAT16_NAN), builder.trunc(rounded, ir.IntType(16)))

    return types.uint16(types.float32), codegen


E4M3_MAX = 448.0  # the largest finite float8 E4M3 (0x7E)
E4M3_MIN_NORMAL = 2.0 ** -6


@njit(inline="always", nogil=True)
def f32_to_e4m3_bits(value):
    """float8 E4M3 bit pattern of a float32, rounded to nearest even and saturated: a magnitude
    beyond E4M3_MAX (infinities too) becomes E4M3_MAX with its sign, as float8 caches do (the
    format has no infinity, and a NaN key would poison every score); NaN stays NaN."""
    if value != value:
        return np.uint8(E4M3_NAN)
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    magnitude = abs(value)
    if magnitude >= E4M3_MAX:  # (448, 464] rounds to 448 and beyond it to 480, not a number here
        return np.uint8(sign | 0x7E)
    if magnitude < E4M3_MIN_NORMAL:  # subnormal: multiples of 2**-9 (8 of them is the least normal)
        return np.uint8(sign | int(np.rint(magnitude * 512.0)))
    exponent = math.frexp(magnitude)[1] - 1  # magnitude in [2**exponent, 2**(exponent + 1))
    eighths = int(np.rint(math.ldexp(magnitude, 3 - exponent)))  # 8..16; 16 carries into the exponent
    return np.uint8(sign | (((exponent + 7) << 3) + eighths - 8))


@njit(cache=True, nogil=True)
def widen(bits, kv_format, out):
    """out[i] = the float32 value of 16-bit pattern bits[i] (exact).

    bits : uint16 [n]; kv_format : FORMAT_FLOAT16 or FORMAT_BFLOAT16; out : float32 [n].
    """
    if kv_format == FORMAT_BFLOAT16:
        for i in range(bits.shape[0]):
            out[i] = bf16_bits_to_f32(bits[i])
    else:
        for i in range(bits.shape[0]):
            out[i] = f16_bits_to_f32(bits[i])


@njit(cache=True, nogil=True)
def narrow(values, kv_format, out):
    """out[i] = values[i] rounded to the 16-bit format (nearest even).

    values : float32 [n]; kv_format : FORMAT_FLOAT16 or FORMAT_BFLOAT16; out : uint16 [n].
    """
    if kv_format == FORMAT_BFLOAT16:
        for i in range(values.shape[0]):
            out[i] = f32_to_bf16_bits(values[i])
    else:
        for i in range(values.shape[0]):
            out[i] = f32_to_f16_bits(values[i])


@njit(cache=True, nogil=True)
def widen_e4m3(bits, out):
    """out[i] = the float32 value of float8 E4M3 pattern bits[i] (exact).

    bits : uint8 [n]; out : float32 [n].
    """
    for i in range(bits.shape[0]):
        out[i] = e4m3_bits_to_f32(bits[i])


@njit(cache=True, nogil=True)
def narrow_e4m3(values, out):
    """out[i] = values[i] as float8 E4M3 (:func:`f32_to_e4m3_bits`).

    values : float32 [n]; out : uint8 [n].
    """
    for i in range(values.shape[0]):
        out[i] = f32_to_e4m3_bits(values[i])
