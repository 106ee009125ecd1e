"""bfloat16 dot products for the attention loops: ``vdpbf16ps`` tiles written in LLVM IR.

Why: with bfloat16 pages the attention loops are bound by float32 multiply-adds, not by memory
(README, "Decode attention": each K and V element feeds one FMA per query head of its GQA group).
AVX512-BF16's ``vdpbf16ps`` multiplies 32 bfloat16 pairs into 16 float32 sums per instruction —
twice the products of a float32 FMA, with no widening instructions. Numba's vectoriser never
emits it, so the two inner loops are written here as IR:

- ``qk_xT`` — scores of R query rows (1-4, the first argument) against T key rows (4 or 1): a
  register tile of R x T accumulators, summed across lanes together at the end: one tree of
  shuffles for the whole tile, not one per dot product; ``qk_f32_xT`` and ``qk_f16_xT``, the
  same tiles on float32 queries and float32 or float16 key rows with FMAs, for float32 and
  float16 caches (as are ``pv_f32`` and ``pv_f16`` below), and ``qk_bf16_xT``/``pv_bf16`` for
  bfloat16 rows widened exactly as they are loaded (the path without bfloat16 products);
- ``pv`` — R accumulator rows (1-4) += probabilities x value rows, two tokens per instruction:
  the rows of tokens t and t + 1 are interleaved so each bfloat16 pair is (v[t, d], v[t + 1, d])
  (by in-lane unpacks, so an accumulator row holds the dimensions in the order ``value_dim``
  gives), and the probabilities arrive packed as (p[t], p[t + 1]) pairs; ``pv_f32``/``pv_f16``, float32
  or float16 value rows by FMAs, 4 chunks of 16 floats of R rows in registers across a page's
  tokens (Numba's loop loaded and stored the accumulators every 4 tokens).

Rows are taken 32 elements (one 512-bit register) at a time, and a last 16 zero-extended when
head_dim % 32 == 16 (80, 112): head_dim must be a multiple of 16.

What is rounded: the products of two bfloat16 numbers are exact in float32 and the sums are
float32, so only what is fed in is rounded — the query (exact when the model's query is bfloat16,
as the scale is applied to the sums, not to the query) and the softmax probabilities, each once to
bfloat16, as FlashAttention does on GPUs. Measured on the benchmark shapes with float32 queries:
outputs within 3e-3 of float64 (relative to the largest output), about one bfloat16 rounding of
the output. Splitting each operand into two bfloat16 halves (16 significant bits) was measured
too: the query's split cost ~10% of the compute ceiling and halved that error; it is not used.

On CPUs without AVX512-BF16 the same IR computes the same products with float32 multiply-adds
(widened pairs, odd lane then even lane, as the instruction does) and gives the same numbers
(subnormal products aside: the instruction flushes them to zero). pagekv.attention does not
take that form on such CPUs — the FMA tiles over widened rows are faster there and round
nothing — but the tests do, so the paired tiles are checked on every CPU.

CPUs with 16 vector registers (AVX2): a <16 x float> takes two, so the FMA tiles keep fewer
accumulators (ACCUMULATORS): a 4 x 4 score tile or a 4-row value tile of 4 chunks spilled them
to the stack on every multiply-add. Measured on an AMD EPYC (Zen 3, AVX2) from L1, 4 query rows,
head_dim 128, cycles per 8-wide FMA at 2.45 GHz: score tile 1.23 -> 0.64 (two key rows per
accumulator, :func:`_make_qk_tile`), value tile 1.47 -> 0.52-0.65 (one chunk per pass).
There the bfloat16 FMA tiles also read rows in pair order (PAIR_ORDER, :func:`pair_dim`): a
32-bit word of a row holds an even and an odd dimension, so a 32-byte load, a shift and a mask
widen 16 dimensions (evens, then odds), where the natural order took two vpmovzxwd and two
shifts; the query is stored in the same order and the sums are put back in order once per row.
Same EPYC, in one process, alternating: from L1 the score tile 0.70-0.90x the time (1-4 rows),
the value tile 0.70-1.05x; S1 bfloat16 decode from L2 30-33 -> 38-41 GFMA/s, G8 39-40 -> 47-56.
"""

from typing import Any

import llvmlite.binding as llvm  # type: ignore[import-untyped]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels.prefetch import CACHE_LINE, emit_prefetch

_HOST_FEATURES = llvm.get_host_cpu_features()
HAS_AVX512_BF16 = bool(_HOST_FEATURES.get("avx512bf16"))
PAIRED = "bfloat16 pairs"  # the storage name of the vdpbf16ps tiles (the others are FMA tiles)
LANES = 16  # float32 lanes of one 512-bit register
PAIRS = 32  # bfloat16 elements of one 512-bit register: one chunk of a row
MAX_ROWS = 4  # query rows of the largest tile; a GQA group's rest takes one tile of 1-3 rows
ROW_REGISTERS = 16  # accumulator registers of the one-row value tile: head_dim <= 256 in registers
# <16 x float> accumulators an FMA tile keeps with room for its operands: 16 of AVX-512's 32
# registers; on AVX2 a <16 x float> takes two of its 16 registers, so 4. Tiles with more
# accumulators spilled them to the stack on every multiply-add (AMD EPYC, AVX2: a 4 x 4 score
# tile held S1 decode to ~40% of the roof).
ACCUMULATORS = 16 if _HOST_FEATURES.get("avx512f") else 4
# bfloat16 rows for the FMA tiles in pair order on AVX2: each 16 dims of a row as their 8 even,
# then 8 odd dims (:func:`pair_dim`), so one 32-byte load, a shift and a mask widen all 16
# (:func:`_load_bf16_pairs`), against two vpmovzxwd and two shifts in natural order.
PAIR_ORDER = ACCUMULATORS < 16
PAIR_BLOCK = 16  # dimensions of a pair-order block

_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32X16 = ir.VectorType(_F32, LANES)
_I16X32 = ir.VectorType(_I16, PAIRS)
_I32X16 = ir.VectorType(_I32, LANES)


class _BFloat(ir.types.Type):
    """LLVM's ``bfloat`` scalar type: llvmlite.ir has none; its IR is text, so printing it is enough."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16X32 = ir.VectorType(_BFloat(), PAIRS)


def _dot_pairs(builder, acc, a, b):
    """acc[i] + a[2i] * b[2i] + a[2i+1] * b[2i+1] for <32 x i16> bfloat16 bit patterns a, b."""
    if HAS_AVX512_BF16:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            _F32X16, [_F32X16, _BF16X32, _BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, builder.bitcast(a, _BF16X32), builder.bitcast(b, _BF16X32)])
    # Portable: widen each half of every pair to float32 (a 16-bit shift) and multiply-add, the odd
    # element first as the instruction does; the products are exact, so fmul + fadd is enough.
    def widen(bits, parity):
        every_other = ir.Constant(_I32X16, [2 * i + parity for i in range(LANES)])
        lanes = builder.shuffle_vector(bits, bits, every_other)
        wide = builder.shl(builder.zext(lanes, _I32X16), ir.Constant(_I32X16, [16] * LANES))
        return builder.bitcast(wide, _F32X16)

    for parity in (1, 0):
        acc = builder.fadd(acc, builder.fmul(widen(a, parity), widen(b, parity)))
    return acc


def _load(builder, address, vector_type):
    return builder.load(builder.inttoptr(address, vector_type.as_pointer()), align=1)


def _broadcast_pair(builder, address):
    """The packed probability pair (32 bits) at address in every lane pair of a <32 x i16>."""
    word = builder.load(builder.inttoptr(address, _I32.as_pointer()))
    one = builder.insert_element(ir.Constant(_I32X16, ir.Undefined), word, ir.Constant(_I32, 0))
    every = builder.shuffle_vector(one, ir.Constant(_I32X16, ir.Undefined), ir.Constant(_I32X16, [0] * LANES))
    return builder.bitcast(every, _I16X32)


def _merge_masks(block):
    """The two shuffles of a merge that halves every ``block``-lane block of x and y (lane
    indices into x ++ y): lane i of the merge is low[i] + high[i], two lanes of one block.

    Each is one cheap instruction: 256-bit halves (vinsertf64x4, vshuff64x2) for block 16,
    128-bit lanes (vshuff32x4) for block 8, in-lane vshufps for blocks 4 and 2. The masks that
    kept every block in place took two-source permutes (vpermt2pd, vpermt2ps) for blocks 8 and
    2, and each row then needed a permute of its own to be stored (4 x 4 score tiles 1.1x faster
    without, from cache)."""
    def of_both(lanes):  # these lanes of x, then the same of y
        return lanes + [LANES + i for i in lanes]

    if block == 16:
        return of_both(list(range(8))), of_both(list(range(8, 16)))
    if block == 8:
        return of_both([0, 1, 2, 3, 8, 9, 10, 11]), of_both([4, 5, 6, 7, 12, 13, 14, 15])
    first, second = ((0, 1), (2, 3)) if block == 4 else ((0, 2), (1, 3))
    low, high = [], []
    for lane in range(0, LANES, 4):
        low += [lane + i for i in first] + [LANES + lane + i for i in first]
        high += [lane + i for i in second] + [LANES + lane + i for i in second]
    return low, high


def _lane_sums(builder, vectors, *, halves=False):
    """The lane sums of up to 16 <16 x float> vectors, as (one vector, lane of each input's sum).

    A tree of merges (two shuffles and an add each, :func:`_merge_masks`) reduces all of them
    together: 45 instructions for 16 vectors, against ~8 each summed alone. Input p of 16 ends
    in lane 4 * (p % 4) + p // 4. With ``halves``, each 8-lane half of a vector is summed on its
    own: the sum of lanes 0-7 of input p is input 2p's, that of lanes 8-15 input 2p + 1's.
    """
    if halves:
        owners = [[2 * i] * (LANES // 2) + [2 * i + 1] * (LANES // 2) for i in range(len(vectors))]
        block = LANES // 2
    else:
        owners = [[i] * LANES for i in range(len(vectors))]
        block = LANES
    mask_type = ir.VectorType(_I32, LANES)
    while len(vectors) > 1 or block > 1:
        if len(vectors) % 2:  # an odd count (or fewer inputs than lanes): merge the last with itself
            vectors, owners = vectors + vectors[-1:], owners + owners[-1:]
        low, high = _merge_masks(block)
        merged, merged_owners = [], []
        for j in range(0, len(vectors), 2):
            x, y = vectors[j], vectors[j + 1]
            merged.append(builder.fadd(builder.shuffle_vector(x, y, ir.Constant(mask_type, low)),
                                       builder.shuffle_vector(x, y, ir.Constant(mask_type, high))))
            both = owners[j] + owners[j + 1]
            merged_owners.append([both[i] for i in low])
        vectors, owners, block = merged, merged_owners, block // 2
    lane_of = {}
    for lane, owner in enumerate(owners[0]):
        lane_of.setdefault(owner, lane)
    return vectors[0], lane_of


def _four_sums(builder, vectors):
    """The lane sums of up to 4 <16 x float> vectors in lanes 0-3 of a <16 x float> (lane i: input
    i's; the lanes above undefined), for CPUs with 256-bit registers: each vector's two halves
    added, then horizontal adds of pairs (vhaddps), then the two 128-bit halves: 9 instructions
    for 4 vectors where :func:`_lane_sums`' merges, built for 512-bit registers, took ~22."""
    eight = ir.VectorType(_F32, 8)

    def half(v, high):
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), [8 * high + i for i in range(8)]))

    def pairwise(a, b):  # vhaddps: per 128-bit lane, a0+a1, a2+a3, b0+b1, b2+b3
        mask = ir.VectorType(_I32, 8)
        evens = builder.shuffle_vector(a, b, ir.Constant(mask, [0, 2, 8, 10, 4, 6, 12, 14]))
        odds = builder.shuffle_vector(a, b, ir.Constant(mask, [1, 3, 9, 11, 5, 7, 13, 15]))
        return builder.fadd(evens, odds)

    folded = [builder.fadd(half(v, 0), half(v, 1)) for v in vectors]
    folded += [ir.Constant(eight, [0.0] * 8)] * (4 - len(folded))
    both = pairwise(pairwise(folded[0], folded[1]), pairwise(folded[2], folded[3]))
    quarter = ir.VectorType(_I32, 4)
    total = builder.fadd(builder.shuffle_vector(both, both, ir.Constant(quarter, [0, 1, 2, 3])),
                         builder.shuffle_vector(both, both, ir.Constant(quarter, [4, 5, 6, 7])))
    return builder.shuffle_vector(total, total, ir.Constant(_I32X16, [i % 4 for i in range(LANES)]))


def _splat(builder, scalar):
    """A <16 x float> of one float32 (or float64, narrowed) value."""
    if scalar.type != _F32:
        scalar = builder.fptrunc(scalar, _F32)
    one = builder.insert_element(ir.Constant(_F32X16, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_F32X16, ir.Undefined), ir.Constant(_I32X16, [0] * LANES))


def _zero_accumulators(builder, count):
    return [cgutils.alloca_once_value(builder, ir.Constant(_F32X16, [0.0] * LANES)) for _ in range(count)]


def _or_current(builder, blocks, current):
    """The block addresses to prefetch with each 0 (no block) replaced by ``current``, the block
    being read: its rows are loaded anyway, so the loops prefetch without a branch.

    Two tests and branches per prefetch had put ~17 of the ~50 instructions in a 4-row value
    tile's loop (per two tokens) and stood in the way of the multiply-adds: without them S1, G7
    and G8 decode from L2 ran in 0.82-0.93x the time, G7/G8 from memory 0.88-0.97x (float32 and
    bfloat16; S1/S2 from memory alike, 0.97-1.04x), AMD EPYC Zen 3, processes alternating. Asking
    for each line once per 32-byte chunk instead of once per 64 bytes (no line test at all)
    gained nothing more (1.00-1.02)."""
    zero = ir.Constant(current.type, 0)
    return [builder.select(builder.icmp_unsigned("!=", block, zero), block, current) for block in blocks]


def _prefetch_each(builder, blocks, offset):
    """Prefetch block + offset for each of the two block addresses (far ahead into L2, and again
    nearer into L1: kernels/prefetch.py)."""
    for near, block in enumerate(blocks):
        emit_prefetch(builder, builder.add(block, offset), into_l1=bool(near))


def _prefetch_lines(builder, blocks, offset, nbytes):
    """:func:`_prefetch_each` of every line in offset .. offset + nbytes - 1 of the blocks (offset
    on a line, nbytes a multiple of 64): a run of the blocks ahead in memory order."""
    for line in range(0, nbytes, CACHE_LINE):
        _prefetch_each(builder, blocks, builder.add(offset, ir.Constant(_I64, line)))


def _prefetch_line(builder, blocks, offset, row_offset):
    """:func:`_prefetch_each` once per 64 bytes of a row read in chunks under 64 bytes: only where
    the chunk starts at a multiple of 64 bytes into its row (``row_offset``), not 2-4 times per
    line. (Chunks of 64 bytes or more make whole lines of every step's share: prefetch_share.)"""
    line_start = builder.icmp_unsigned("==", builder.and_(row_offset, ir.Constant(_I64, 63)),
                                       ir.Constant(_I64, 0))
    with builder.if_then(line_start):
        _prefetch_each(builder, blocks, offset)


def _load_f16(builder, address, lanes=LANES):
    """``lanes`` float16 numbers at address, widened to float32."""
    return builder.fpext(_load(builder, address, ir.VectorType(ir.HalfType(), lanes)),
                         ir.VectorType(_F32, lanes))


def _load_bf16_wide(builder, address, lanes=LANES):
    """``lanes`` bfloat16 numbers at address, widened to float32: each 16-bit pattern shifted into
    the top of a 32-bit lane (vpmovzxwd, vpslld), exact."""
    wide = ir.VectorType(_I32, lanes)
    bits = builder.zext(_load(builder, address, ir.VectorType(_I16, lanes)), wide)
    return builder.bitcast(builder.shl(bits, ir.Constant(wide, [16] * lanes)), ir.VectorType(_F32, lanes))


def _load_bf16_pairs(builder, address):
    """The PAIR_BLOCK bfloat16 numbers at address as float32, exactly, in pair order: (even
    dims, odd dims), two <8 x float>. Each 32-bit word holds an even dim in its low half and the
    next odd dim in its high half: shifted left 16 bits it is the even one, masked the odd."""
    words = _load(builder, address, ir.VectorType(_I32, PAIR_BLOCK // 2))
    half = ir.VectorType(_F32, PAIR_BLOCK // 2)
    evens = builder.shl(words, ir.Constant(words.type, [16] * (PAIR_BLOCK // 2)))
    odds = builder.and_(words, ir.Constant(words.type, [0xFFFF0000] * (PAIR_BLOCK // 2)))
    return builder.bitcast(evens, half), builder.bitcast(odds, half)


def _load_wide(builder, address, storage, lanes=LANES):
    """``lanes`` numbers of ``storage`` (float32, float16 or bfloat16) at address as float32."""
    if storage == "float32":
        return _load(builder, address, ir.VectorType(_F32, lanes))
    return (_load_f16 if storage == "float16" else _load_bf16_wide)(builder, address, lanes)


def _join(builder, low, high):
    """One <16 x float> of two <8 x float>: low in lanes 0-7, high in lanes 8-15."""
    return builder.shuffle_vector(low, high, ir.Constant(_I32X16, list(range(LANES))))


def _load_bf16(builder, address, width):
    """``width`` (32 or 16) bfloat16 bits at address as a <32 x i16>, zeros above a 16-wide load."""
    if width == PAIRS:
        return _load(builder, address, _I16X32)
    half = _load(builder, address, ir.VectorType(_I16, LANES))
    return builder.shuffle_vector(half, ir.Constant(ir.VectorType(_I16, LANES), [0] * LANES),
                                  ir.Constant(ir.VectorType(_I32, PAIRS), list(range(PAIRS))))


def _over_head_dim(builder, head_dim, step):
    """Call step(byte offset, width) for each 32-element chunk of a bfloat16 row of head_dim
    elements, then once with width 16 if head_dim % 32 == 16 (head_dim 80, 112)."""
    chunks = builder.lshr(head_dim, ir.Constant(_I64, 5))
    with cgutils.for_range(builder, chunks) as loop:
        step(builder.mul(loop.index, ir.Constant(_I64, PAIRS * 2)), PAIRS)
    tail = builder.icmp_unsigned("!=", builder.and_(head_dim, ir.Constant(_I64, LANES)), ir.Constant(_I64, 0))
    with builder.if_then(tail):
        step(builder.mul(chunks, ir.Constant(_I64, PAIRS * 2)), LANES)


def _fma(builder, acc, a, b):
    """acc + a * b, fused, for <16 x float> vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3),
                                        "llvm.fma.v16f32")
    return builder.call(fn, [a, b, acc])


def _rows_switch(builder, rows, emit):
    """emit(n) under ``rows == n`` for n = 4, 3, 2, 1: one intrinsic holds the tiles of every row
    count the page loops take (4-row tiles, then one of 3, 2 or 1 rows for the rest)."""
    for n in range(MAX_ROWS, 0, -1):
        with builder.if_then(builder.icmp_signed("==", rows, ir.Constant(rows.type, n))):
            emit(n)


def _score_order(rows, tokens):
    """The order in which a tile's rows x tokens sums (index r * tokens + t) enter the lane-sum
    tree: for a 4 x 4 tile, the one that leaves row r's 4 scores in order in 128-bit lane r
    (input p ends in lane 4 * (p % 4) + p // 4), so a row is stored straight from its lane
    instead of being gathered by a permute."""
    if (rows, tokens) != (4, 4):
        return list(range(rows * tokens))
    return [r * 4 + t for t in range(4) for r in range(4)]


def _keys_per_pass(rows, tokens, halves):
    """How many of a tile's key rows one walk of head_dim takes with ``rows`` query rows: all of
    them where the accumulators fit in registers with room for the operands (ACCUMULATORS
    vectors, holding one key row each, or two with ``halves``), else fewer, in several walks
    (each key row is read from L1 once either way)."""
    return min(tokens, max(1, ACCUMULATORS // rows) * (2 if halves else 1))


def _make_qk_tile(tokens, *, storage=PAIRED):
    """Tiles of rows x tokens scores, rows (1-4) the first argument, head_dim a multiple of 16:
    bfloat16 key rows and queries by vdpbf16ps (``storage=PAIRED``), or float32 queries and
    float32, float16 or bfloat16 key rows (widened as they are loaded) by FMAs; with bfloat16
    keys and PAIR_ORDER the query rows are in pair order (:func:`pair_dim`).

    FMA tiles on CPUs with 16 vector registers (AVX2: ACCUMULATORS < 16) put two key rows in each
    accumulator, 8 dimensions of each (``halves``): a 4-row tile then keeps 2 keys x 4 rows in 8
    registers and loads each query chunk once for both keys. With one key row per accumulator
    it kept 1 key x 4 rows, loaded 10 vectors per 8 multiply-adds and reduced 4 accumulators
    per key (scores from L1 at ~1 cycle per multiply-add, against ~0.55 for the value tile).
    A one-row tile (MHA, a GQA group's last row) keeps one key per accumulator all the same:
    4 keys in 8 registers are 8 independent chains of multiply-adds, where two keys per
    accumulator were 4 chains, each waiting on its last FMA (S3 bfloat16 decode from L2 0.93x
    the time, AMD EPYC Zen 3, separate processes alternating); its 4 sums take
    :func:`_four_sums`."""
    fma = storage != PAIRED

    def emit(builder, rows, q_first, q_step, k_first, k_step, dims, factor, out_base, out_step, *pf):
        halves = fma and ACCUMULATORS < 16 and tokens > 1 and rows > 1
        per_pass = _keys_per_pass(rows, tokens, halves) if fma else tokens
        pf = _or_current(builder, pf, k_first)
        for first in range(0, tokens, per_pass):
            keys = min(per_pass, tokens - first)
            skip = builder.mul(k_step, ir.Constant(_I64, first))
            pf_rows = [builder.add(block, skip) for block in pf]  # this pass's rows of the blocks ahead
            emit_pass(builder, rows, keys, halves, q_first, q_step, builder.add(k_first, skip), k_step,
                      dims, factor, builder.add(out_base, ir.Constant(_I64, 4 * first)), out_step,
                      *pf_rows)

    def emit_pass(builder, rows, tokens, halves, q_first, q_step, k_first, k_step, dims, factor,
                  out_base, out_step, *pf):
        """The scores of ``rows`` query rows against ``tokens`` key rows, in one walk of head_dim."""
        per_vector = 2 if halves else 1  # key rows per accumulator
        vectors = tokens // per_vector
        sums = _zero_accumulators(builder, rows * vectors)
        dot = _fma if fma else _dot_pairs
        key_bytes = 4 if storage == "float32" else 2

        def share_is_whole_lines(chunk_bytes):
            """Whether a step's chunks of the pass's rows make whole lines: then the step
            prefetches its share of them (:func:`prefetch_share`), else each row its own line
            (:func:`key_row`) - one or the other, never both."""
            return (tokens * chunk_bytes) % CACHE_LINE == 0

        def key_row(t, key_offset, chunk_bytes):
            """The address of key row t's chunk at key_offset; when a step reads less than whole
            lines of the pass's rows, the same line of the blocks ahead is prefetched
            (:func:`_prefetch_line`; else :func:`prefetch_share`)."""
            row = builder.add(builder.mul(k_step, ir.Constant(_I64, t)), key_offset)
            if not share_is_whole_lines(chunk_bytes):
                _prefetch_line(builder, pf, row, key_offset)
            return builder.add(k_first, row)

        def prefetch_share(key_offset, chunk_bytes):
            """This step's share of the pass's rows in the blocks ahead, in memory order: the
            step at key_offset of each row prefetches bytes key_offset * tokens onwards (whole
            lines; the rows are consecutive). Each row's own line instead made the pass's 2-4
            rows interleaved streams 256 bytes apart (head_dim 128, bfloat16). AMD EPYC Zen 3,
            processes alternating, from memory: MHA with 8 heads x 128 (16 x 2,048 tokens)
            0.78-0.88x the time, G8 0.88-0.96x, S1/S2/S3 0.90-1.06x; from L2 0.95-1.03x."""
            if share_is_whole_lines(chunk_bytes):
                _prefetch_lines(builder, pf, builder.mul(key_offset, ir.Constant(_I64, tokens)),
                                tokens * chunk_bytes)

        def multiply(offset, width, key_offset=None):
            """One chunk of every row: bytes ``offset`` into the query rows, ``key_offset`` (if
            not the same) into the key rows; ``width`` elements of each row (8 with halves)."""
            key_offset = offset if key_offset is None else key_offset
            keys_of_chunk = []
            chunk_bytes = width * key_bytes if fma else 64
            prefetch_share(key_offset, chunk_bytes)
            for j in range(vectors):
                if halves:
                    pair = [_load_wide(builder, key_row(2 * j + h, key_offset, chunk_bytes), storage,
                                       width) for h in range(2)]
                    keys_of_chunk.append(_join(builder, *pair))
                elif fma:
                    keys_of_chunk.append(_load_wide(builder, key_row(j, key_offset, chunk_bytes), storage))
                else:
                    keys_of_chunk.append(_load_bf16(builder, key_row(j, key_offset, chunk_bytes), width))
            for r in range(rows):
                address = builder.add(q_first, builder.add(builder.mul(q_step, ir.Constant(_I64, r)), offset))
                if halves:
                    half = _load(builder, address, ir.VectorType(_F32, width))
                    query = _join(builder, half, half)
                elif fma:
                    query = _load(builder, address, _F32X16)
                else:
                    query = _load_bf16(builder, address, width)
                for j, key in enumerate(keys_of_chunk):
                    s = sums[r * vectors + j]
                    builder.store(dot(builder, builder.load(s), query, key), s)

        def multiply_pairs(offset):
            """One PAIR_BLOCK of every row in pair order (bfloat16 keys): ``offset`` bytes into
            the query rows (float32, in pair order), half that into the key rows."""
            key_offset = builder.lshr(offset, ir.Constant(_I64, 1))
            prefetch_share(key_offset, PAIR_BLOCK * 2)
            pieces = [_load_bf16_pairs(builder, key_row(j, key_offset, PAIR_BLOCK * 2))
                      for j in range(tokens)]  # (evens, odds) of each key row
            half = ir.VectorType(_F32, PAIR_BLOCK // 2)
            for r in range(rows):
                address = builder.add(q_first, builder.add(builder.mul(q_step, ir.Constant(_I64, r)), offset))
                q_halves = [_load(builder, builder.add(address, ir.Constant(_I64, 4 * i * (PAIR_BLOCK // 2))),
                                  half) for i in range(2)]
                for j in range(vectors):
                    if halves:  # key rows 2j and 2j + 1 side by side, the query's piece twice
                        operands = [(_join(builder, pieces[2 * j][i], pieces[2 * j + 1][i]),
                                     _join(builder, q_halves[i], q_halves[i])) for i in range(2)]
                    else:  # one key row: its block in one vector, as the query's
                        operands = [(_join(builder, *pieces[j]), _join(builder, *q_halves))]
                    s = sums[r * vectors + j]
                    acc = builder.load(s)
                    for key, query in operands:
                        acc = _fma(builder, acc, query, key)
                    builder.store(acc, s)

        if fma and storage == "bfloat16" and PAIR_ORDER:
            with cgutils.for_range(builder, builder.udiv(dims, ir.Constant(_I64, PAIR_BLOCK))) as loop:
                multiply_pairs(builder.mul(loop.index, ir.Constant(_I64, PAIR_BLOCK * 4)))
        elif fma:  # chunks of 16 floats (8 with halves) of the query rows and of the key rows
            width = LANES // per_vector
            with cgutils.for_range(builder, builder.udiv(dims, ir.Constant(_I64, width))) as loop:
                multiply(builder.mul(loop.index, ir.Constant(_I64, width * 4)), width,
                         builder.mul(loop.index, ir.Constant(_I64, width * key_bytes)))
        else:
            _over_head_dim(builder, dims, multiply)
        if fma and ACCUMULATORS < 16 and not halves and len(sums) <= 4:  # all AVX2 passes without halves
            total = _four_sums(builder, [builder.load(s) for s in sums])
            lane_of = {i: i for i in range(len(sums))}
        else:
            order = _score_order(rows, tokens) if not halves else list(range(rows * vectors))
            total, lane_at = _lane_sums(builder, [builder.load(sums[i]) for i in order], halves=halves)
            if halves:  # vector v's halves are scores 2v and 2v + 1 (= r * tokens + t)
                lane_of = lane_at
            else:
                lane_of = {order[position]: lane for position, lane in lane_at.items()}
        total = builder.fmul(total, _splat(builder, factor))
        row_type = ir.VectorType(_F32, tokens)
        for r in range(rows):  # one store per row (one shuffle, or none for a 4 x 4 tile)
            address = builder.add(out_base, builder.mul(out_step, ir.Constant(_I64, r)))
            lanes = ir.Constant(ir.VectorType(_I32, tokens), [lane_of[r * tokens + t] for t in range(tokens)])
            row = builder.shuffle_vector(total, ir.Constant(_F32X16, ir.Undefined), lanes)
            builder.store(row, builder.inttoptr(address, row_type.as_pointer()), align=4)

    @intrinsic
    def tile(typingctx, rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out, out_stride,
             pf_base, again_base):
        signature = types.void(rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out,
                               out_stride, pf_base, again_base)

        def codegen(context, builder, sig, args):
            _rows_switch(builder, args[0], lambda n: emit(builder, n, *args[1:]))
            return context.get_dummy_value()

        return signature, codegen

    tile.__doc__ = (f"Scores of ``rows`` (1-4) query rows against {tokens} consecutive key rows "
                    f"({storage} keys, head_dim a multiple of 16), times "
                    "scale: out + r * out_stride holds row r's. The same rows of the blocks at "
                    "pf_base and again_base are prefetched (0: none, the tile's own rows again).")
    return tile


# A GQA group's query rows take tiles of 4 rows, and one tile of 3, 2 or 1 for the rest: each tile
# pass loads the keys and interleaves the values once for all its rows, so 3 rows in one tile cost
# little more than 1. Against one-row tiles for the rest (decode, 16 x 2,048 tokens, page 16, caches
# flushed, alternating rounds, time ratio old/new from memory): group 2 (16/8 heads x 128) 1.23x
# (float32, ~57 GB/s roof), 8/2 x 128 float32 1.10x, 16/8 x 256 bfloat16 1.30x; group 3 (24/8 x
# 128) 1.48x in both dtypes; group 6 (12/2 x 128) 1.13-1.25x; group 7 (28/4 x 128) 1.30-1.45x;
# from cache 1.3-2x. Groups 1, 4 and 5 (4 + 1) take the same tiles as before (0.98-1.01x).
qk_x4 = _make_qk_tile(4)
qk_x1 = _make_qk_tile(1)
# The float32 tiles serve prefill and decode. In prefill the score tiles were 7-29% faster than
# Numba's own loops (which reduce each score's lanes alone) and the value tiles (below) made
# prefill 1.4-1.7x faster in all (2K causal, head_dim 64/80/128). In decode, memory-bound, the
# one-row tiles of MHA read 2-10% faster from memory (S3 and MHA shapes at head_dim 64/80/128).
# With GQA's tiles decode read 5-9% slower from memory than the loops while each line was
# prefetched once; asked for twice (kernels/prefetch.py) they read alike or faster (S1/S2 0.98-1.01x
# the loops' time, 2 or 8 KV heads x 64: 0.82-0.97x) and compute 1.1-1.5x faster from cache
# (group 2, then two one-row tiles per KV head: 14-15% slower at head_dim 128, before the 2-row tile).
qk_f32_x4 = _make_qk_tile(4, storage="float32")
qk_f32_x1 = _make_qk_tile(1, storage="float32")
# float16 keys (and values, pv_f16): the float32 tiles on rows widened as they are loaded
# (vcvtph2ps). Numba's loops, which widen element by element, held float16 decode below the roof
# even from cache (S1 81% of ~35 GB/s); with these tiles decode is 1.07-1.45x faster from memory
# (S1/S2/S3, groups 3 and 7) and prefill 1.15-1.38x.
qk_f16_x4 = _make_qk_tile(4, storage="float16")
qk_f16_x1 = _make_qk_tile(1, storage="float16")
# bfloat16 keys and values by the same FMA tiles, each row widened exactly as it is loaded (a
# shift): on CPUs without AVX512-BF16 they replace the vdpbf16ps tiles, whose portable form is
# no faster than float32 math and rounds the query and probabilities for nothing, and they are
# the exact path (fast_bf16=False) on every CPU. pagekv.attention chooses.
qk_bf16_x4 = _make_qk_tile(4, storage="bfloat16")
qk_bf16_x1 = _make_qk_tile(1, storage="bfloat16")


def _unpack_masks(width):
    """vpunpcklwd and vpunpckhwd of rows v0, v1 of ``width`` (32 or 16) bfloat16 (indices into
    v0 ++ v1): within each 128-bit lane L, the pairs (v0[d], v1[d]) of d = 8L .. 8L + 3 (low) and
    of d = 8L + 4 .. 8L + 7 (high)."""
    low, high = [], []
    for lane in range(width // 8):
        for i in range(4):
            low += [8 * lane + i, width + 8 * lane + i]
            high += [8 * lane + 4 + i, width + 8 * lane + 4 + i]
    return low, high


def _interleave(builder, v0, v1, width):
    """Rows t and t + 1 (``width`` bfloat16 each) as width / 16 <32 x i16> vectors of pairs
    (v0[d], v1[d]): one float32 lane per d under vdpbf16ps, in the order :func:`value_dim` gives.

    In-lane unpacks, one cheap instruction each, rather than a two-source permute (vpermt2w) into
    the natural order of d: the 4-row value tile ran 1.14x faster so from cache (1.1-1.3x for 2-4
    rows in a C microbenchmark), bfloat16 prefill at head_dim 128 1.04-1.06x. The accumulators
    keep the unpacks' order of d, and the kernels put each output row back in order when they
    write it."""
    low, high = _unpack_masks(width)
    mask = ir.VectorType(_I32, width)
    halves = [builder.shuffle_vector(v0, v1, ir.Constant(mask, m)) for m in (low, high)]
    if width == PAIRS:
        return halves
    return [builder.shuffle_vector(*halves, ir.Constant(ir.VectorType(_I32, PAIRS), list(range(PAIRS))))]


def _make_pv_tile(*, storage=PAIRED):
    """Value tiles of ``rows`` (1-4, the first argument) accumulator rows: bfloat16 value rows by
    vdpbf16ps with packed probability pairs (``storage=PAIRED``), or float32, float16 or bfloat16
    value rows (widened as they are loaded) and float32 probabilities by FMAs; with bfloat16 rows
    and PAIR_ORDER the accumulator rows are in pair order (:func:`pair_dim`)."""
    def emit(builder, rows, *args):
        acc_first, acc_step, v_first, v_step, p_first, p_step, n, dims = args[:8]
        pf = _or_current(builder, args[8:], v_first)
        if storage != PAIRED:
            _values_f32(builder, rows, *args[:8], pf, storage=storage)
            return
        sums = _zero_accumulators(builder, 2 * rows)
        num_pairs = builder.lshr(n, ir.Constant(_I64, 1))

        def acc_pointer(r, half, offset):  # offset: bytes into a bfloat16 row
            base = builder.add(acc_first, builder.mul(acc_step, ir.Constant(_I64, r)))
            address = builder.add(builder.add(base, builder.mul(offset, ir.Constant(_I64, 2))),
                                  ir.Constant(_I64, half * LANES * 4))
            return builder.inttoptr(address, _F32X16.as_pointer())

        def load_row(row, width):
            return _load(builder, builder.add(v_first, row), ir.VectorType(_I16, width))

        def accumulate(pair_vectors, pair):
            for r in range(rows):
                p_row = builder.add(builder.mul(p_step, ir.Constant(_I64, r)),
                                    builder.mul(pair, ir.Constant(_I64, 4)))
                probs = _broadcast_pair(builder, builder.add(p_first, p_row))
                for half, pairs in enumerate(pair_vectors):
                    s = sums[2 * r + half]
                    builder.store(_dot_pairs(builder, builder.load(s), pairs, probs), s)

        def values(offset, width):
            halves = width // LANES
            for r in range(rows):
                for half in range(halves):
                    builder.store(builder.load(acc_pointer(r, half, offset), align=4), sums[2 * r + half])
            with cgutils.for_range(builder, num_pairs) as loop:
                token = builder.mul(loop.index, ir.Constant(_I64, 2))
                row0 = builder.add(builder.mul(v_step, token), offset)
                row1 = builder.add(row0, v_step)
                for row in (row0, row1):
                    _prefetch_each(builder, pf, row)
                accumulate(_interleave(builder, load_row(row0, width), load_row(row1, width), width),
                           loop.index)
            odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
            with builder.if_then(odd):  # the last token alone: its partner row may be stale bytes
                row0 = builder.add(builder.mul(v_step, builder.sub(n, ir.Constant(_I64, 1))), offset)
                _prefetch_each(builder, pf, row0)
                zeros = ir.Constant(ir.VectorType(_I16, width), [0] * width)
                accumulate(_interleave(builder, load_row(row0, width), zeros, width), num_pairs)
            for r in range(rows):
                for half in range(halves):
                    builder.store(builder.load(sums[2 * r + half]), acc_pointer(r, half, offset), align=4)

        if rows > 1:
            _over_head_dim(builder, dims, values)
            return
        # One row: walk the value rows in order (all of a row pair's chunks, then the next
        # pair) with the whole accumulator row in registers: up to 16 vectors, head_dim <= 256,
        # the chunk loop unrolled and guarded. Measured at S3 (MHA, page 16, three runs each):
        # the in-order walk overlaps prefetched memory better, 76-79% -> 81-84% of the roof.
        # For 2 rows (GQA) it measured alike, so 4-row tiles keep the chunk-outer walk.
        in_order = builder.icmp_unsigned("<=", dims, ir.Constant(_I64, ROW_REGISTERS * LANES))
        with builder.if_else(in_order) as (short_rows, long_rows):
            with short_rows:
                _values_in_order(builder, dims, n, num_pairs, v_first, v_step, p_first, acc_first, pf)
            with long_rows:
                _over_head_dim(builder, dims, values)

    @intrinsic
    def tile(typingctx, rows, acc_base, acc_stride, v_base, v_stride, p_base, p_stride, num_tokens,
             head_dim, pf_base, again_base):
        signature = types.void(rows, acc_base, acc_stride, v_base, v_stride, p_base, p_stride,
                               num_tokens, head_dim, pf_base, again_base)

        def codegen(context, builder, sig, args):
            _rows_switch(builder, args[0], lambda n: emit(builder, n, *args[1:]))
            return context.get_dummy_value()

        return signature, codegen

    tile.__doc__ = ("acc[r] += sum over t < num_tokens of p[r, t] * v[t] for ``rows`` (1-4) rows: "
                    + (f"{storage} value rows (head_dim a multiple of 16) and float32 probabilities, "
                       "one per token." if storage != PAIRED else
                       "bfloat16 value rows (head_dim a multiple of 16), float32 accumulators (each "
                       "row's dimensions in the order of value_dim), probabilities packed as "
                       "bfloat16 pairs.")
                    + " The same rows of the blocks at pf_base and again_base are prefetched (0: none, "
                    "the tile's own rows again).")
    return tile


def _values_in_order(builder, dims, n, num_pairs, v_first, v_step, p_first, acc_first, pf):
    """acc += p @ v for one accumulator row, value rows in memory order (all chunks of a row pair,
    then the next pair), the accumulator row in ROW_REGISTERS registers (head_dim <= 256); pf:
    the addresses of the blocks to prefetch."""
    sums = _zero_accumulators(builder, ROW_REGISTERS)  # allocas with constant indices: registers
    full = builder.lshr(dims, ir.Constant(_I64, 5))
    tail = builder.icmp_unsigned("!=", builder.and_(dims, ir.Constant(_I64, LANES)), ir.Constant(_I64, 0))
    acc = builder.inttoptr(acc_first, _F32X16.as_pointer())

    def each_chunk(body):
        """body(chunk, width) for the row's chunks, unrolled: chunk c is 32 wide if c < full,
        16 wide if c == full and head_dim % 32 == 16."""
        for c in range(ROW_REGISTERS // 2):
            is_full = builder.icmp_unsigned(">", full, ir.Constant(_I64, c))
            with builder.if_else(is_full) as (whole, rest):
                with whole:
                    body(c, PAIRS)
                with rest:
                    is_tail = builder.and_(tail, builder.icmp_unsigned("==", full, ir.Constant(_I64, c)))
                    with builder.if_then(is_tail):
                        body(c, LANES)

    def load_acc(c, width):
        for h in range(width // LANES):
            pointer = builder.gep(acc, [ir.Constant(_I64, 2 * c + h)])
            builder.store(builder.load(pointer, align=4), sums[2 * c + h])

    def store_acc(c, width):
        for h in range(width // LANES):
            pointer = builder.gep(acc, [ir.Constant(_I64, 2 * c + h)])
            builder.store(builder.load(sums[2 * c + h]), pointer, align=4)

    def pair_of_rows(pair, row0, row1):
        probs = _broadcast_pair(builder, builder.add(p_first, builder.mul(pair, ir.Constant(_I64, 4))))

        def chunk(c, width):
            offset = ir.Constant(_I64, c * PAIRS * 2)
            rows = []
            for row in (row0, row1):
                if row is None:  # the odd last token alone: its partner row may be stale bytes
                    rows.append(ir.Constant(ir.VectorType(_I16, width), [0] * width))
                    continue
                _prefetch_each(builder, pf, builder.add(row, offset))
                rows.append(_load(builder, builder.add(v_first, builder.add(row, offset)),
                                  ir.VectorType(_I16, width)))
            for h, pairs in enumerate(_interleave(builder, rows[0], rows[1], width)):
                s = sums[2 * c + h]
                builder.store(_dot_pairs(builder, builder.load(s), pairs, probs), s)

        each_chunk(chunk)

    each_chunk(load_acc)
    with cgutils.for_range(builder, num_pairs) as loop:
        row0 = builder.mul(v_step, builder.mul(loop.index, ir.Constant(_I64, 2)))
        pair_of_rows(loop.index, row0, builder.add(row0, v_step))
    odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
    with builder.if_then(odd):
        pair_of_rows(num_pairs, builder.mul(v_step, builder.sub(n, ir.Constant(_I64, 1))), None)
    each_chunk(store_acc)


pv = _make_pv_tile()

F32_CHUNKS = 4  # 16-float chunks of a value row per pass of the float32 value tile


def _values_f32(builder, rows, acc_first, acc_step, v_first, v_step, p_first, p_step, n, dims, pf,
                *, storage):
    """acc += p @ v for ``rows`` accumulator rows of float32: F32_CHUNKS chunks of 16 floats of
    each row per pass (fewer where they would not fit in registers: ACCUMULATORS), held in
    registers across all n value rows (then head_dim's last chunks); the probabilities are
    float32, one per token (p_first + r * p_step: row r's); pf: the addresses of the blocks to
    prefetch. The value rows are of ``storage`` (float32, float16 or bfloat16; the 16-bit ones
    widened as they are loaded).

    The passes read the block in columns (a 4-row bfloat16 tile at head_dim 128: 8 passes of 32
    bytes of every row), but each pass prefetches its share of the block ahead in memory order
    (pass j of P the j-th P-th of it, a token pair's share at a time): prefetched in the columns
    the passes read, each 4 KiB block was asked for in 4 sweeps of 16 lines 256 bytes apart, and
    the memory served those streams slower. AMD EPYC Zen 3, processes alternating, from memory:
    S1 0.79-0.86x the time (bfloat16), 0.78-0.95x (float32), S2 0.78-0.83x, G7 0.82-0.95x, G8
    0.82-0.92x; S3 (one pass already) 1.00x; from L2 0.95-1.03x, prefill 0.96-0.99x."""
    half = storage != "float32"
    value_bytes = 2 if half else 4
    chunk_bytes = LANES * value_bytes
    per_pass = max(1, min(F32_CHUNKS, ACCUMULATORS // rows))  # chunks of each row in registers
    sums = _zero_accumulators(builder, rows * per_pass)

    def acc_pointer(r, offset):
        address = builder.add(builder.add(acc_first, builder.mul(acc_step, ir.Constant(_I64, r))), offset)
        return builder.inttoptr(address, _F32X16.as_pointer())

    def chunks_at(offset, chunks):
        """The pass over chunks from ``offset`` bytes into the accumulator rows."""
        steps = [ir.Constant(_I64, c * LANES * 4) for c in range(chunks)]
        v_steps = [ir.Constant(_I64, c * chunk_bytes) for c in range(chunks)]
        v_offset = builder.lshr(offset, ir.Constant(_I64, 1)) if half else offset
        width = chunks * chunk_bytes  # bytes of a value row this pass reads
        share = builder.mul(v_offset, n)  # where this pass's share of the block ahead starts

        def token(t, prefetch_bytes):
            """One value row's multiply-adds; before them, ``prefetch_bytes`` of the pass's share of
            the block ahead from where token t's part of it starts (whole lines)."""
            ahead = builder.and_(builder.add(share, builder.mul(t, ir.Constant(_I64, width))),
                                 ir.Constant(_I64, -CACHE_LINE))
            _prefetch_lines(builder, pf, ahead, prefetch_bytes)
            row = builder.add(builder.mul(v_step, t), v_offset)
            values = []
            for c in range(chunks):
                address = builder.add(v_first, builder.add(row, v_steps[c]))
                if storage == "bfloat16" and PAIR_ORDER:  # a chunk is one block: in pair order
                    values.append(_join(builder, *_load_bf16_pairs(builder, address)))
                else:
                    values.append(_load_wide(builder, address, storage))
            for r in range(rows):
                p_row = builder.add(builder.mul(p_step, ir.Constant(_I64, r)),
                                    builder.mul(t, ir.Constant(_I64, 4)))
                prob = _splat(builder, builder.load(builder.inttoptr(builder.add(p_first, p_row),
                                                                     _F32.as_pointer())))
                for c in range(chunks):
                    s = sums[r * per_pass + c]
                    builder.store(_fma(builder, builder.load(s), values[c], prob), s)

        for r in range(rows):
            for c in range(chunks):
                pointer = acc_pointer(r, builder.add(offset, steps[c]))
                builder.store(builder.load(pointer, align=4), sums[r * per_pass + c])
        # Token pairs: a pair's 2 * width bytes are whole lines (width is a multiple of 32), so
        # each line is asked for once with no test (a test per token cost 1.13x the time from L2).
        pair_lines = -(-2 * width // CACHE_LINE) * CACHE_LINE
        with cgutils.for_range(builder, builder.lshr(n, ir.Constant(_I64, 1))) as loop:
            first = builder.shl(loop.index, ir.Constant(_I64, 1))
            token(first, pair_lines)
            token(builder.add(first, ir.Constant(_I64, 1)), 0)
        odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(_I64, 1)), ir.Constant(_I64, 0))
        with builder.if_then(odd):  # the last token alone
            token(builder.sub(n, ir.Constant(_I64, 1)), -(-width // CACHE_LINE) * CACHE_LINE)
        for r in range(rows):
            for c in range(chunks):
                pointer = acc_pointer(r, builder.add(offset, steps[c]))
                builder.store(builder.load(sums[r * per_pass + c]), pointer, align=4)

    pass_bytes = ir.Constant(_I64, per_pass * LANES * 4)
    passes = builder.udiv(dims, ir.Constant(_I64, per_pass * LANES))
    with cgutils.for_range(builder, passes) as loop:
        chunks_at(builder.mul(loop.index, pass_bytes), per_pass)
    left = builder.udiv(builder.urem(dims, ir.Constant(_I64, per_pass * LANES)), ir.Constant(_I64, LANES))
    for chunks in range(1, per_pass):  # head_dim 80, 96, 112, ...: the last 1-3 chunks
        with builder.if_then(builder.icmp_unsigned("==", left, ir.Constant(_I64, chunks))):
            chunks_at(builder.mul(passes, pass_bytes), chunks)


pv_f32 = _make_pv_tile(storage="float32")
pv_f16 = _make_pv_tile(storage="float16")
pv_bf16 = _make_pv_tile(storage="bfloat16")


@intrinsic
def _f32_bits(typingctx, x):
    """The bit pattern of a float32, as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(types.float32), codegen


_JIT: dict[str, Any] = dict(cache=True, error_model="numpy", nogil=True)


@njit(inline="always", **_JIT)
def value_dim(j, head_dim):
    """The dimension d that position j of a bfloat16 value tile's accumulator row holds (the
    order of :func:`_interleave`'s unpacks): in each 32 positions, j = 16h + 4g + i holds
    d = 8g + 4h + i; in a last 16 (head_dim % 32 == 16), j = 8h + 4g + i holds the same d."""
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
