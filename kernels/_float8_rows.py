"""A block of float8 rows turned into bfloat16 once, for GQA groups of more than 4 query heads.

The vdpbf16ps tiles over float8 pages (``PAIRED_FLOAT8``) turn each row into bfloat16 as they load
it (kernels/_tile_ir.py, e4m3_words): free of extra traffic when one tile of up to 4 query rows
reads a block, but a group of 5-8 query heads takes two tiles per block, and each converted every
row again. :func:`widen_block` converts the block once into a stack buffer; the bfloat16 tiles
(``PAIRED``) then read it from L1 (kernels/page_loops.py, widening_page_loops). Prefill's chunk
value tile takes 8 of an item's 32-128 query rows at a time: its value blocks are turned into a
per-thread buffer once per chunk (:func:`widen_into`; kernels/attention.py, _prefill_kernel).
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels._math import JIT
from pagekv.kernels._tile_ir import (CACHE_LINE, I16, I32, I32X16, I64, LANES, PAIRS, e4m3_words,
                                     or_current, prefetch_each)

# The largest block converted (bfloat16 bytes): page_size x head_dim up to 16,384 numbers, e.g. 64 x
# 256 or 128 x 128; larger blocks keep converting in the tiles. Half of a 64 KiB L1, at most.
SCRATCH_BYTES = 32 * 1024


@intrinsic
def _stack_scratch(typingctx):
    """The address of a SCRATCH_BYTES buffer on the calling function's stack (64-byte aligned,
    allocated once on entry, the same for every call there)."""
    def codegen(context, builder, signature, args):
        buffer = cgutils.alloca_once(builder, ir.ArrayType(I32X16, SCRATCH_BYTES // 64))
        return builder.ptrtoint(buffer, I64)

    return types.int64(), codegen


@intrinsic
def _widen_rows(typingctx, source, count, destination, pf_base, again_base):
    """destination (count bfloat16 numbers, 2 bytes each) <- the count float8 numbers at source,
    count a multiple of 16; each 64 bytes of source prefetch the same line of the blocks at pf_base
    and again_base (0: the source's own line, read anyway: no branch, as or_current says)."""
    def codegen(context, builder, signature, args):
        src, n, dst, pf, again = [context.cast(builder, value, ty, types.int64)
                                  for value, ty in zip(args, signature.args)]
        blocks = or_current(builder, [pf, again], src)
        natural = [list(range(PAIRS)), list(range(PAIRS, 2 * PAIRS))]
        with cgutils.for_range(builder, builder.lshr(n, ir.Constant(I64, 6))) as loop:
            offset = builder.shl(loop.index, ir.Constant(I64, 6))
            prefetch_each(builder, blocks, offset)
            row = builder.add(src, offset)
            halves = [row, builder.add(row, ir.Constant(I64, PAIRS))]
            words = e4m3_words(builder, halves, PAIRS, natural)
            for half, vector in enumerate(words):
                address = builder.add(dst, builder.add(builder.shl(offset, ir.Constant(I64, 1)),
                                                       ir.Constant(I64, half * CACHE_LINE)))
                builder.store(vector, builder.inttoptr(address, vector.type.as_pointer()), align=1)
        # The last 16, 32 or 48 numbers, 16 at a time.
        first = builder.and_(n, ir.Constant(I64, -CACHE_LINE))
        pieces = builder.lshr(builder.sub(n, first), ir.Constant(I64, 4))
        sixteen = ir.VectorType(I16, LANES)
        with cgutils.for_range(builder, pieces) as loop:
            offset = builder.add(first, builder.shl(loop.index, ir.Constant(I64, 4)))
            pick = list(range(LANES)) + [None] * LANES
            (words,) = e4m3_words(builder, [builder.add(src, offset)], LANES, [pick])
            low = builder.shuffle_vector(words, words, ir.Constant(ir.VectorType(I32, LANES),
                                                                   list(range(LANES))))
            address = builder.add(dst, builder.shl(offset, ir.Constant(I64, 1)))
            builder.store(low, builder.inttoptr(address, sixteen.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(source, count, destination, pf_base, again_base), codegen


@njit(inline="always", **JIT)
def widen_into(block, count, destination, ahead):
    """destination (an address: count bfloat16 numbers) <- the ``count`` float8 numbers of the
    block at address ``block`` (a multiple of 16), the same lines of the block at ``ahead``
    prefetched (0: the block's own)."""
    _widen_rows(block, count, destination, ahead, 0)


@njit(inline="always", **JIT)
def widen_block(block, count, ahead, again):
    """The address of a stack buffer holding the ``count`` float8 numbers of the block at address
    ``block`` as bfloat16 (count * 2 <= SCRATCH_BYTES, a multiple of 16), the same lines of the
    blocks at ``ahead`` and ``again`` prefetched (0: the block's own)."""
    scratch = _stack_scratch()
    _widen_rows(block, count, scratch, ahead, again)
    return scratch
