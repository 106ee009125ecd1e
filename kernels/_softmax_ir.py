"""A row of the softmax in 512-bit vectors, written as LLVM IR: the largest scaled score, and the
probabilities stored straight as bfloat16 (the value tiles' input) with their float32 sum.

Why IR: Numba's loops over the same arithmetic (:func:`pagekv.kernels.online_softmax.softmax_update`,
then :func:`pagekv.kernels._tile_rows.pack_pairs`) compile to 256-bit vectors on the Intel Xeon
(LLVM prefers them there) and take four passes over the scores: scale, max, exp, pack. They took
57% of the AMX prefill's cycles (S1: softmax 43%, packing 9%, scaling 5%; the tiles 34%; cycle
counters around each phase, docs/performance.md). Here a row takes two passes of <16 x float>.

The exponential is 2^(x log2 e) by Cephes' ``exp2f`` (degree-6 polynomial on [-0.5, 0.5], relative
error ~2e-7, as accurate as :func:`pagekv.kernels._math.fast_exp`), its power clamped at
-125.5: no probability is below ~1.7e-38 (where fast_exp gives 0), far below what a sum that
holds a 1 keeps, and none is subnormal, which vcvtneps2bf16 would flush. The bfloat16 rounding
is :func:`pagekv.kernels._tile_rows.to_bf16`'s (to nearest even), so the value tiles see what the
``vdpbf16ps`` path would give them for the same float32 probability. The last n % 16 elements
take the same arithmetic on scalars.
"""

import math

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels._tile_ir import F32, F32X16, HAS_AVX512_BF16, I32, I32X16, LANES, _BFloat, splat

I16 = ir.IntType(16)
I64 = ir.IntType(64)
I16X16 = ir.VectorType(I16, LANES)
_BF16X16 = ir.VectorType(_BFloat(), LANES)
_LOG2E = 1.0 / math.log(2.0)
# The smallest power taken: from it p stays a normal float32 (n >= -126 and f >= 0 where n is
# -126), as vcvtneps2bf16 flushes subnormals, which the integer rounding keeps
_LOWEST = -125.5
_ROUNDER = 1.5 * 2.0 ** 23
# Cephes exp2f: 2^f = 1 + f P(f) on [-0.5, 0.5], highest power first
_EXP2_POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3,
              5.550332471162809e-2, 2.402264791363012e-1, 6.931472028550421e-1)


def _const(kind, value):
    """A float32 (or int32) constant, splat to 16 lanes where ``kind`` is a vector type."""
    if isinstance(kind, ir.VectorType):
        return ir.Constant(kind, [value] * kind.count)
    return ir.Constant(kind, value)


def _call(builder, name, kind, args):
    """The LLVM intrinsic ``name`` over float32 or <16 x float> (llvmlite cannot name vector
    overloads)."""
    suffix = ".v16f32" if isinstance(kind, ir.VectorType) else ".f32"
    fnty = ir.FunctionType(kind, [kind] * len(args))
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name + suffix), args)


def _max(builder, a, b):
    """The larger of a and b (b where either is NaN: the scores hold none): one vmaxps, where
    llvm.maxnum adds NaN fix-ups."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _fence(builder, value):
    """``value``, which the caller's fast-math flags may not reassociate or contract across: Numba
    puts its flags ("reassoc", "contract") on every float instruction of the function, these too,
    and (y + 1.5 * 2^23) - 1.5 * 2^23 would fold to y, s * scale - m into an fma."""
    return _call(builder, "llvm.arithmetic.fence", value.type, [value])


def _splat(builder, scalar, kind):
    """A float32 as ``kind``: itself, or in all 16 lanes."""
    return splat(builder, scalar) if isinstance(kind, ir.VectorType) else scalar


def _exp_bf16(builder, scores, scale, offset):
    """p = exp(scores * scale - offset) and its bfloat16 bits, for a float32 or <16 x float>."""
    kind = scores.type
    ints = I32X16 if isinstance(kind, ir.VectorType) else I32
    # rounded product, then the difference (no fma): the row's largest score gives exactly 0
    # and p = 1, as in softmax_update, which scales the scores before it subtracts the max
    x = builder.fsub(_fence(builder, builder.fmul(scores, scale)), offset)
    y = _max(builder, builder.fmul(x, _const(kind, _LOG2E)), _const(kind, _LOWEST))
    # n = y rounded to nearest: adding 1.5 * 2^23 leaves it in the low mantissa bits, whose
    # integer (mod 2^32) also builds 2^n, so no round or convert instruction
    shifted = _fence(builder, builder.fadd(y, _const(kind, _ROUNDER)))
    f = builder.fsub(y, _fence(builder, builder.fsub(shifted, _const(kind, _ROUNDER))))
    poly = _const(kind, _EXP2_POLY[0])
    for c in _EXP2_POLY[1:]:
        poly = _call(builder, "llvm.fma", kind, [poly, f, _const(kind, c)])
    mantissa = _call(builder, "llvm.fma", kind, [f, poly, _const(kind, 1.0)])
    exponent = builder.shl(builder.add(builder.bitcast(shifted, ints), _const(ints, 127)), _const(ints, 23))
    p = builder.fmul(mantissa, builder.bitcast(exponent, kind))
    if isinstance(kind, ir.VectorType) and HAS_AVX512_BF16:  # one vcvtneps2bf16: the same rounding
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_BF16X16, [F32X16]),
                                            "llvm.x86.avx512bf16.cvtneps2bf16.512")
        return p, builder.bitcast(builder.call(fn, [p]), I16X16)
    bits = builder.bitcast(p, ints)
    odd = builder.and_(builder.lshr(bits, _const(ints, 16)), _const(ints, 1))
    rounded = builder.lshr(builder.add(builder.add(bits, _const(ints, 0x7FFF)), odd), _const(ints, 16))
    return p, builder.trunc(rounded, I16X16 if isinstance(kind, ir.VectorType) else I16)


def _lanes_fold(builder, vector, combine):
    """combine(...) of a <16 x float>'s lanes, pairwise."""
    lanes = [builder.extract_element(vector, ir.Constant(I32, i)) for i in range(LANES)]
    while len(lanes) > 1:
        lanes = [combine(lanes[i], lanes[i + 1]) for i in range(0, len(lanes), 2)]
    return lanes[0]


def _over_row(builder, count, body):
    """body(kind, element) for the full vectors of a row, then for the scalars left."""
    vectors = builder.ashr(count, ir.Constant(count.type, 4))
    with cgutils.for_range(builder, vectors) as loop:
        body(F32X16, builder.mul(loop.index, ir.Constant(count.type, LANES)))
    rest = builder.mul(vectors, ir.Constant(count.type, LANES))
    with cgutils.for_range_slice(builder, rest, count, ir.Constant(count.type, 1)) as (i, _):
        body(F32, i)


def _running(builder, start):
    """A loop-carried float32 and <16 x float>, each set to ``start`` here (the allocas sit in the
    entry block, which runs once however often the caller's loop calls the intrinsic)."""
    slots = {}
    for kind in (F32X16, F32):
        slots[kind] = cgutils.alloca_once(builder, kind)
        builder.store(_const(kind, start), slots[kind])
    return slots


def _words(*kinds):
    """Whether every type is a 64-bit integer (an address or a count: i64 in the IR)."""
    return all(isinstance(k, types.Integer) and k.bitwidth == 64 for k in kinds)


def _pointer(builder, address, index, size, kind):
    """The pointer to element ``index`` (``size`` bytes each) from ``address``, as ``kind``."""
    element = builder.add(address, builder.mul(index, ir.Constant(I64, size)))
    return builder.inttoptr(element, kind.as_pointer())


@intrinsic
def scaled_max(typingctx, address, count, scale):
    """max(scale * x[i]) over the ``count`` (>= 1) float32 x at ``address``, as float32."""
    if not (_words(address, count) and scale == types.float32):
        return None
    signature = types.float32(address, count, scale)

    def codegen(context, builder, sig, args):
        address, count, scale = args
        tops = _running(builder, -math.inf)

        def body(kind, i):
            x = builder.load(_pointer(builder, address, i, 4, kind), align=4)
            top = _max(builder, builder.load(tops[kind]), builder.fmul(x, _splat(builder, scale, kind)))
            builder.store(top, tops[kind])

        _over_row(builder, count, body)
        larger = lambda a, b: _max(builder, a, b)  # noqa: E731
        return larger(_lanes_fold(builder, builder.load(tops[F32X16]), larger), builder.load(tops[F32]))

    return signature, codegen


@intrinsic
def exp_to_bf16(typingctx, address, count, scale, offset, out):
    """p[i] = exp(scale * x[i] - offset) for the ``count`` float32 x at ``address``: stores them as
    bfloat16 bits at ``out`` (2 bytes each) and returns their float32 sum."""
    if not (_words(address, count, out) and scale == offset == types.float32):
        return None
    signature = types.float32(address, count, scale, offset, out)

    def codegen(context, builder, sig, args):
        address, count, scale, offset, out = args
        sums = _running(builder, 0.0)

        def body(kind, i):
            x = builder.load(_pointer(builder, address, i, 4, kind), align=4)
            p, bits = _exp_bf16(builder, x, _splat(builder, scale, kind), _splat(builder, offset, kind))
            builder.store(bits, _pointer(builder, out, i, 2, bits.type), align=2)
            builder.store(builder.fadd(builder.load(sums[kind]), p), sums[kind])

        _over_row(builder, count, body)
        return builder.fadd(_lanes_fold(builder, builder.load(sums[F32X16]), builder.fadd),
                            builder.load(sums[F32]))

    return signature, codegen
