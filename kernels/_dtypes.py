"""16-bit storage inside Numba kernels: float16 and bfloat16 pages as uint16 bit patterns.

Numba cannot take a float16 array on the CPU at all, and has no bfloat16, so 16-bit caches reach the
kernels as ``uint16`` arrays plus a format code. Each page of one head is widened to float32 once,
into a small per-thread buffer, and the attention math runs on float32 (fp32 accumulation).

The widening is emitted as LLVM IR, so the conversion loops vectorise: ``fpext half -> float``
becomes ``vcvtph2ps`` where the CPU has F16C; bfloat16 -> float32 is exact as a 16-bit shift.
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


def page_as_f32(cache, page, head, num_tokens, kv_format, scratch):
    """The first ``num_tokens`` rows of ``cache[page, head]`` as float32 ``[page_size, head_dim]``.

    A float32 cache is returned as a view (no copy); a uint16 cache is widened into ``scratch``.
    Only callable from Numba code (an ``overload`` below supplies the implementation).
    """
    raise NotImplementedError("page_as_f32 is only callable from Numba-compiled code")


@overload(page_as_f32, jit_options={"fastmath": True})
def _page_as_f32(cache, page, head, num_tokens, kv_format, scratch):
    if cache.dtype == types.float32:
        def view(cache, page, head, num_tokens, kv_format, scratch):
            return cache[page, head]
        return view

    if cache.dtype == types.uint16:
        def widen(cache, page, head, num_tokens, kv_format, scratch):
            src = cache[page, head]
            head_dim = src.shape[1]
            if kv_format == FORMAT_BFLOAT16:
                for t in range(num_tokens):
                    for d in range(head_dim):
                        scratch[t, d] = bf16_bits_to_f32(src[t, d])
            else:
                for t in range(num_tokens):
                    for d in range(head_dim):
                        scratch[t, d] = f16_bits_to_f32(src[t, d])
            return scratch
        return widen
    return None
