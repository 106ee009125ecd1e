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
    """Where the float32 values of ``cache[page, head]`` (its first ``num_tokens`` rows) can be read.

    Returns ``(array, page, head)`` with ``array`` a 4-D float32 array: the cache itself for a
    float32 cache (no copy), or ``scratch`` ``[1, 1, page_size, head_dim]`` holding the widened
    16-bit values, with page and head 0. Indexing a 4-D array element by element, rather than
    taking a ``cache[page, head]`` view, matters: every view costs an atomic reference-count update on
    the cache, which all threads share.
    Only callable from Numba code (an ``overload`` below supplies the implementation).
    """
    raise NotImplementedError("page_as_f32 is only callable from Numba-compiled code")


@overload(page_as_f32, jit_options={"fastmath": True})
def _page_as_f32(cache, page, head, num_tokens, kv_format, scratch):
    if cache.dtype == types.float32:
        def direct(cache, page, head, num_tokens, kv_format, scratch):
            return cache, page, head
        return direct

    if cache.dtype == types.uint16:
        def widen(cache, page, head, num_tokens, kv_format, scratch):
            head_dim = cache.shape[3]
            if kv_format == FORMAT_BFLOAT16:
                for t in range(num_tokens):
                    for d in range(head_dim):
                        scratch[0, 0, t, d] = bf16_bits_to_f32(cache[page, head, t, d])
            else:
                for t in range(num_tokens):
                    for d in range(head_dim):
                        scratch[0, 0, t, d] = f16_bits_to_f32(cache[page, head, t, d])
            return scratch, 0, 0
        return widen
    return None
