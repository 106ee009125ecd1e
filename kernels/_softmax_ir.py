"""The softmax in 512-bit vectors, written as LLVM IR: a row's largest scaled score and its
probabilities stored straight as bfloat16 (the value tiles' input) with their float32 sum; and the
same down the columns of decode's scores, 16 query rows to a vector, into the AMX value tiles' A
rows.

Why IR: Numba's loops over the same arithmetic (:func:`pagekv.kernels.online_softmax.softmax_update`,
then :func:`pagekv.kernels._tile_rows.pack_pairs`) compile to 256-bit vectors on the Intel Xeon
(LLVM prefers them there) and take four passes over the scores: scale, max, exp, pack. They took
57% of the AMX prefill's cycles (S1: softmax 43%, packing 9%, scaling 5%; the tiles 34%; cycle
counters around each phase, docs/performance.md). Here a row takes two passes of <16 x float>.

The exponential is 2^y, y = x scale log2(e) - max log2(e) by one multiply-add (so the largest
score's p is 1 to within ~1e-6, not exactly), its power clamped at -125.5: no probability is
below ~1.7e-38 (where fast_exp gives 0), far below what a sum that holds a 1 keeps, and none is
subnormal, which vcvtneps2bf16 would flush. 2^y = 2^n (1 + f P(f)), n = y rounded, by a
polynomial within 1.9e-7 of it (as accurate as :func:`pagekv.kernels._math.fast_exp`) and, on
AVX-512, one ``vscalefps``: ~16 instructions per 16 scores. The bfloat16 rounding is
:func:`pagekv.kernels._tile_rows.to_bf16`'s (to nearest even), so the value tiles see what the
``vdpbf16ps`` path would give them for the same float32 probability. A row's last n % 16
elements take the same arithmetic on scalars.
"""

import math

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels._tile_ir import (F32, F32X16, HAS_AVX512_BF16, HAS_AVX512F, I32, I32X16, LANES, _BFloat,
                                     splat, transposed)

I16 = ir.IntType(16)
I64 = ir.IntType(64)
I16X16 = ir.VectorType(I16, LANES)
_BF16X16 = ir.VectorType(_BFloat(), LANES)
_LOG2E = 1.0 / math.log(2.0)
# The smallest power taken: from it p stays a normal float32 (n >= -126 and f >= 0 where n is
# -126), as vcvtneps2bf16 flushes subnormals, which the integer rounding keeps
_LOWEST = -125.5
_ROUNDER = 1.5 * 2.0 ** 23
# 2^f = 1 + f P(f) on [-0.5, 0.5], highest power first: P of degree 4 fitted to the relative error
# (weighted least squares reweighted towards minimax, Lawson's method, in float64); evaluated in
# float32 it is within 1.9e-7 of 2^f (Cephes' exp2f, a degree higher: 1e-7)
_EXP2_POLY = (1.326472731307149e-3, 9.671512991189957e-3, 5.550733581185341e-2,
              2.402224242687225e-1, 6.931470036506653e-1)


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


def _exp_bf16(builder, scores, slope, intercept):
    """p = 2^(scores * slope + intercept) and its bfloat16 bits, for a float32 or <16 x float>
    (slope and intercept alike)."""
    kind = scores.type
    ints = I32X16 if isinstance(kind, ir.VectorType) else I32
    y = _max(builder, _call(builder, "llvm.fma", kind, [scores, slope, intercept]), _const(kind, _LOWEST))
    # n = y rounded to nearest: adding 1.5 * 2^23 leaves it in the low mantissa bits, whose
    # integer (mod 2^32) also builds 2^n, so no round or convert instruction
    shifted = _fence(builder, builder.fadd(y, _const(kind, _ROUNDER)))
    n = _fence(builder, builder.fsub(shifted, _const(kind, _ROUNDER)))
    f = builder.fsub(y, n)
    poly = _const(kind, _EXP2_POLY[0])
    for c in _EXP2_POLY[1:]:
        poly = _call(builder, "llvm.fma", kind, [poly, f, _const(kind, c)])
    mantissa = _call(builder, "llvm.fma", kind, [f, poly, _const(kind, 1.0)])
    if isinstance(kind, ir.VectorType) and HAS_AVX512F:  # one vscalefps: mantissa * 2^n
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(F32X16, [F32X16, F32X16, F32X16, I16, I32]),
            "llvm.x86.avx512.mask.scalef.ps.512")
        p = builder.call(fn, [mantissa, n, mantissa, ir.Constant(I16, -1), ir.Constant(I32, 4)])
    else:
        exponent = builder.shl(builder.add(builder.bitcast(shifted, ints), _const(ints, 127)),
                               _const(ints, 23))
        p = builder.fmul(mantissa, builder.bitcast(exponent, kind))
    if isinstance(kind, ir.VectorType) and HAS_AVX512_BF16:  # one vcvtneps2bf16: the same rounding
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_BF16X16, [F32X16]),
                                            "llvm.x86.avx512bf16.cvtneps2bf16.512")
        return p, builder.bitcast(builder.call(fn, [p]), I16X16)
    bits = builder.bitcast(p, ints)
    odd = builder.and_(builder.lshr(bits, _const(ints, 16)), _const(ints, 1))
    rounded = builder.lshr(builder.add(builder.add(bits, _const(ints, 0x7FFF)), odd), _const(ints, 16))
    return p, builder.trunc(rounded, I16X16 if isinstance(kind, ir.VectorType) else I16)


def _base2(builder, scale, offset):
    """(slope, intercept) with exp(x scale - offset) = 2^(x slope + intercept), one multiply-add per
    x (:func:`_exp_bf16`): scale float32, offset float32 or <16 x float> (intercept alike)."""
    return (builder.fmul(scale, _const(F32, _LOG2E)),
            builder.fmul(builder.fneg(offset), _const(offset.type, _LOG2E)))


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

        slope, intercept = _base2(builder, scale, offset)

        def body(kind, i):
            x = builder.load(_pointer(builder, address, i, 4, kind), align=4)
            p, bits = _exp_bf16(builder, x, _splat(builder, slope, kind), _splat(builder, intercept, kind))
            builder.store(bits, _pointer(builder, out, i, 2, bits.type), align=2)
            builder.store(builder.fadd(builder.load(sums[kind]), p), sums[kind])

        _over_row(builder, count, body)
        return builder.fadd(_lanes_fold(builder, builder.load(sums[F32X16]), builder.fadd),
                            builder.load(sums[F32]))

    return signature, codegen


# Decode's scores lie key by key (the AMX score tiles' S^T = K Q^T: a row per key, a column per
# query row), so its softmax runs down the columns, 16 query rows to a vector: no lane folds and
# no loop per query row, where a query row of one chunk is only 8 vectors (128 keys).
def _row(builder, address, t, step, kind):
    """Row t of a strip (``step`` bytes per row) from ``address``, as a pointer to ``kind``."""
    return builder.inttoptr(builder.add(address, builder.mul(t, step)), kind.as_pointer())


@intrinsic
def strip_max(typingctx, address, step, begin, end, scale, out):
    """out[j] = max(scale * x[t, j] for begin <= t < end) for j < 16 (begin < end), as 16
    float32 at ``out``: x[t, j] is the float32 at address + t * step + 4 j."""
    if not (_words(address, step, begin, end, out) and scale == types.float32):
        return None
    signature = types.void(address, step, begin, end, scale, out)

    def codegen(context, builder, sig, args):
        address, step, begin, end, scale, out = args
        top = cgutils.alloca_once(builder, F32X16)
        builder.store(_const(F32X16, -math.inf), top)
        factor = splat(builder, scale)
        with cgutils.for_range_slice(builder, begin, end, ir.Constant(I64, 1)) as (t, _):
            x = builder.load(_row(builder, address, t, step, F32X16), align=4)
            builder.store(_max(builder, builder.load(top), builder.fmul(x, factor)), top)
        builder.store(builder.load(top), builder.inttoptr(out, F32X16.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def exp_to_pairs(typingctx, address, step, first, begin, end, scale, offsets, sums, out, out_step):
    """The probabilities of keys first .. first + 15 for 16 query rows, as the value tiles' A rows:
    p[t, j] = exp(scale * x[t, j] - offsets[j]) (x as in :func:`strip_max`; 0 outside begin <= t
    < end) rounded to bfloat16, stored for query row j at ``out`` + 2 j out_step + 4 (t - first)
    in the low half of each word (the high half 0), and at ``out`` + (2 j + 1) out_step shifted
    into the high half; sums[j] += the float32 sum of row j's p.

    offsets, sums : addresses of 16 float32 each.
    """
    if not (_words(address, step, first, begin, end, offsets, sums, out, out_step)
            and scale == types.float32):
        return None
    signature = types.void(address, step, first, begin, end, scale, offsets, sums, out, out_step)

    def codegen(context, builder, sig, args):
        address, step, first, begin, end, scale, offsets, sums, out, out_step = args
        offset = builder.load(builder.inttoptr(offsets, F32X16.as_pointer()), align=4)
        slope, intercept = _base2(builder, scale, offset)
        slope = splat(builder, slope)
        total = builder.load(builder.inttoptr(sums, F32X16.as_pointer()), align=4)
        words = []
        for i in range(LANES):
            t = builder.add(first, ir.Constant(I64, i))
            p, bits = _exp_bf16(builder, builder.load(_row(builder, address, t, step, F32X16), align=4),
                                slope, intercept)
            kept = builder.and_(builder.icmp_signed(">=", t, begin), builder.icmp_signed("<", t, end))
            total = builder.fadd(total, builder.select(kept, p, _const(F32X16, 0.0)))
            words.append(builder.select(kept, builder.zext(bits, I32X16), _const(I32X16, 0)))
        builder.store(total, builder.inttoptr(sums, F32X16.as_pointer()), align=4)
        target = builder.add(out, builder.mul(first, ir.Constant(I64, 4)))
        for j, row in enumerate(transposed(builder, words)):
            even = builder.add(target, builder.mul(out_step, ir.Constant(I64, 2 * j)))
            builder.store(row, builder.inttoptr(even, I32X16.as_pointer()), align=4)
            odd = builder.add(even, out_step)
            builder.store(builder.shl(row, _const(I32X16, 16)), builder.inttoptr(odd, I32X16.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    return signature, codegen
