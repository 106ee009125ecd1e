"""Narrow storage inside Numba kernels: float16 and bfloat16 pages as uint16 bit patterns, float8
(OCP E4M3, ``float8_e4m3fn``) pages as uint8 bit patterns.

Numba cannot take a float16 array on the CPU at all, and has no bfloat16 or float8, so narrow
caches reach the kernels as ``uint16`` or ``uint8`` arrays plus a format code. ``load_f32`` widens
each element as the attention loops read it (float32 math, float32 accumulation). Widening in the loads, rather than into a
per-page float32 buffer first, made bfloat16 decode 21-40% faster (no 8 KiB store and reload per
page and head).

The widening is emitted as LLVM IR, so the loops still vectorise: ``fpext half -> float`` becomes
``vcvtph2ps`` where the CPU has F16C; bfloat16 -> float32 is exact as a 16-bit shift; float8 E4M3
goes through float16 (:func:`e4m3_to_f32`).
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.extending import intrinsic, overload

FORMAT_FLOAT32 = 0
FORMAT_FLOAT16 = 1
FORMAT_BFLOAT16 = 2
FORMAT_FLOAT8_E4M3FN = 3
E4M3_NAN = 0x7F  # S.1111.111, the format's only NaN (no infinities); its largest finite is 448


def e4m3_to_f32(builder, bits):
    """float32 values of E4M3 bit patterns ``bits`` (i16, or a vector of i16, each holding one
    zero-extended byte), exact, NaN kept. The byte shifted into the top of its 16 bits and back
    down one bit (arithmetically, so the sign lands on bits 15 and 14; bit 14 then cleared) is a
    float16 of value / 256, subnormals included (E4M3's exponent bias is 7, float16's 15):
    widened by vcvtph2ps where the CPU has F16C, multiplied by 256. Three integer instructions
    per vector, where taking the sign and the magnitude apart took five."""
    def const(value, of=bits.type):
        if isinstance(of, ir.VectorType):
            return ir.Constant(of, [value] * of.count)
        return ir.Constant(of, value)

    vector = isinstance(bits.type, ir.VectorType)
    float_type = ir.VectorType(ir.FloatType(), bits.type.count) if vector else ir.FloatType()
    half_type = ir.VectorType(ir.HalfType(), bits.type.count) if vector else ir.HalfType()
    spread = builder.ashr(builder.shl(bits, const(8)), const(1))
    half_bits = builder.and_(spread, const(0xBFFF))
    value = builder.fmul(builder.fpext(builder.bitcast(half_bits, half_type), float_type),
                         const(256.0, float_type))
    # E4M3's NaN, S.1111.111, is the float16 pattern of +-1.875 here: its magnitude bits 0x3F80.
    is_nan = builder.icmp_unsigned("==", builder.and_(half_bits, const(0x7FFF)), const(E4M3_NAN << 7))
    return builder.select(is_nan, const(float("nan"), float_type), value)


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


@intrinsic
def e4m3_bits_to_f32(typingctx, bits):
    """float32 value of a float8 E4M3 bit pattern (exact, NaN kept)."""
    if bits != types.uint8:
        return None

    def codegen(context, builder, signature, args):
        return e4m3_to_f32(builder, builder.zext(args[0], ir.IntType(16)))

    return types.float32(types.uint8), codegen


def load_f32(cache, page, head, token, dim, kv_format):
    """``cache[page, head, token, dim]`` as float32, widened in place from 16- or 8-bit storage.

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
    if cache.dtype == types.uint8:
        def widen_e4m3(cache, page, head, token, dim, kv_format):
            return e4m3_bits_to_f32(cache[page, head, token, dim])
        return widen_e4m3
    return None
