"""The building blocks of the attention kernels' register tiles, as LLVM IR.

The tiles (kernels/_score_tiles.py: query x key; kernels/_value_tiles.py: probabilities x
values) are the two inner loops of the page loops, written as IR because Numba's vectoriser never
emits what they need: with bfloat16 pages the attention loops are bound by float32 multiply-adds,
not by memory (docs/performance.md, "Decode attention": each K and V element feeds one FMA per
query head of its GQA group). AVX512-BF16's ``vdpbf16ps`` multiplies 32 bfloat16 pairs into 16
float32 sums per instruction, twice the products of a float32 FMA with no widening instructions; on
other CPUs, float32 FMAs on rows widened as they are loaded. Each tile comes in one *storage*:
``PAIRED`` (bfloat16 rows by vdpbf16ps), ``PAIRED_FLOAT8`` (float8_e4m3fn rows turned into
bfloat16 as they are loaded, by vdpbf16ps: :func:`e4m3_words`), or float32, float16, bfloat16 or
float8_e4m3fn rows by FMAs (ELEMENT_BYTES).

Rows are taken 32 elements (one 512-bit register) at a time, and a last 16 zero-extended when
head_dim % 32 == 16 (80, 112): head_dim must be a multiple of 16.

What is rounded: the products of two bfloat16 numbers are exact in float32 and the sums are
float32, so only what is fed in is rounded — the query (exact when the model's query is bfloat16,
as the scale is applied to the sums, not to the query) and the softmax probabilities, each once to
bfloat16 (kernels/_tile_rows.py), as FlashAttention does on GPUs. Measured on the benchmark
shapes with float32 queries: outputs within 3e-3 of float64 (relative to the largest output),
about one bfloat16 rounding of the output. Splitting each operand into two bfloat16 halves (16
significant bits) was measured too: the query's split cost ~10% of the compute ceiling and halved
that error; it is not used.

On CPUs without AVX512-BF16 the same IR computes the same products with float32 multiply-adds
(widened pairs, odd lane then even lane, as the instruction does) and gives the same numbers
(subnormal products aside: the instruction flushes them to zero). pagekv.attention does not
take that form on such CPUs — the FMA tiles over widened rows are faster there and round
nothing — but the tests do, so the paired tiles are checked on every CPU.

CPUs with 16 vector registers (AVX2): a <16 x float> takes two, so the FMA tiles keep fewer
accumulators (ACCUMULATORS): a 4 x 4 score tile or a 4-row value tile of 4 chunks spilled them
to the stack on every multiply-add. Measured on an AMD EPYC (Zen 3, AVX2) from L1, 4 query rows,
head_dim 128, cycles per 8-wide FMA at 2.45 GHz: score tile 1.23 -> 0.64 (two key rows per
accumulator), value tile 1.47 -> 0.52-0.65 (one chunk per pass).
There the bfloat16 FMA tiles also read rows in pair order (PAIR_ORDER, kernels/_tile_rows.py):
a 32-bit word of a row holds an even and an odd dimension, so a 32-byte load, a shift and a mask
widen 16 dimensions (evens, then odds), where the natural order took two vpmovzxwd and two
shifts; the query is stored in the same order and the sums are put back in order once per row.
Same EPYC, in one process, alternating: from L1 the score tile 0.70-0.90x the time (1-4 rows),
the value tile 0.70-1.05x; S1 bfloat16 decode from L2 30-33 -> 38-41 GFMA/s, G8 39-40 -> 47-56.
"""

import math
import struct

import llvmlite.binding as llvm  # type: ignore[import-untyped]
from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels import prefetch
from pagekv.kernels._dtypes import E4M3_NAN, e4m3_to_f32
from pagekv.kernels.prefetch import CACHE_LINE, emit_prefetch

_HOST_FEATURES = llvm.get_host_cpu_features()
HAS_AVX512_BF16 = bool(_HOST_FEATURES.get("avx512bf16"))
HAS_AVX512F = bool(_HOST_FEATURES.get("avx512f"))
HAS_AVX512_VBMI = bool(_HOST_FEATURES.get("avx512vbmi"))  # vpermi2b: float8 -> bfloat16 by tables
# The storage names of the vdpbf16ps tiles (the others are FMA tiles) and their bytes per element.
PAIRED = "bfloat16 pairs"
PAIRED_FLOAT8 = "float8_e4m3fn pairs"
PAIR_BYTES = {PAIRED: 2, PAIRED_FLOAT8: 1}
LANES = 16  # float32 lanes of one 512-bit register
PAIRS = 32  # bfloat16 elements of one 512-bit register: one chunk of a row
MAX_ROWS = 4  # query rows of the largest tile; a GQA group's rest takes one tile of 1-3 rows
ROW_REGISTERS = 16  # accumulator registers of the one-row value tile: head_dim <= 256 in registers
# <16 x float> accumulators an FMA tile keeps with room for its operands: 16 of AVX-512's 32
# registers; on AVX2 a <16 x float> takes two of its 16 registers, so 4. Tiles with more
# accumulators spilled them to the stack on every multiply-add (AMD EPYC, AVX2: a 4 x 4 score
# tile held S1 decode to ~40% of the roof).
ACCUMULATORS = 16 if HAS_AVX512F else 4
# bfloat16 rows for the FMA tiles in pair order on AVX2: each 16 dims of a row as their 8 even,
# then 8 odd dims (pair_dim, kernels/_tile_rows.py), so one 32-byte load, a shift and a mask widen all 16
# (:func:`load_bf16_pairs`), against two vpmovzxwd and two shifts in natural order.
PAIR_ORDER = ACCUMULATORS < 16
PAIR_BLOCK = 16  # dimensions of a pair-order block

F32 = ir.FloatType()
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
I8 = ir.IntType(8)
F32X16 = ir.VectorType(F32, LANES)
I8X64 = ir.VectorType(I8, 2 * PAIRS)
I16X32 = ir.VectorType(I16, PAIRS)
I32X16 = ir.VectorType(I32, LANES)


class _BFloat(ir.types.Type):
    """LLVM's ``bfloat`` scalar type: llvmlite.ir has none; its IR is text, so printing it is enough."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


_BF16X32 = ir.VectorType(_BFloat(), PAIRS)


def dot_pairs(builder, acc, a, b):
    """acc[i] + a[2i] * b[2i] + a[2i+1] * b[2i+1] for <32 x i16> bfloat16 bit patterns a, b."""
    if HAS_AVX512_BF16:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            F32X16, [F32X16, _BF16X32, _BF16X32]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, builder.bitcast(a, _BF16X32), builder.bitcast(b, _BF16X32)])
    # Portable: widen each half of every pair to float32 (a 16-bit shift) and multiply-add, the odd
    # element first as the instruction does; the products are exact, so fmul + fadd is enough.
    def widen(bits, parity):
        every_other = ir.Constant(I32X16, [2 * i + parity for i in range(LANES)])
        lanes = builder.shuffle_vector(bits, bits, every_other)
        wide = builder.shl(builder.zext(lanes, I32X16), ir.Constant(I32X16, [16] * LANES))
        return builder.bitcast(wide, F32X16)

    for parity in (1, 0):
        acc = builder.fadd(acc, builder.fmul(widen(a, parity), widen(b, parity)))
    return acc


def load(builder, address, vector_type):
    return builder.load(builder.inttoptr(address, vector_type.as_pointer()), align=1)


def broadcast_pair(builder, address):
    """The packed probability pair (32 bits) at address in every lane pair of a <32 x i16>."""
    word = builder.load(builder.inttoptr(address, I32.as_pointer()))
    one = builder.insert_element(ir.Constant(I32X16, ir.Undefined), word, ir.Constant(I32, 0))
    every = builder.shuffle_vector(one, ir.Constant(I32X16, ir.Undefined), ir.Constant(I32X16, [0] * LANES))
    return builder.bitcast(every, I16X32)


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


def lane_sums(builder, vectors, *, halves=False):
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
    mask_type = ir.VectorType(I32, LANES)
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


def four_sums(builder, vectors):
    """The lane sums of up to 4 <16 x float> vectors in lanes 0-3 of a <16 x float> (lane i: input
    i's; the lanes above undefined), for CPUs with 256-bit registers: each vector's two halves
    added, then horizontal adds of pairs (vhaddps), then the two 128-bit halves: 9 instructions
    for 4 vectors where :func:`lane_sums`' merges, built for 512-bit registers, took ~22."""
    eight = ir.VectorType(F32, 8)

    def half(v, high):
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 8), [8 * high + i for i in range(8)]))

    def pairwise(a, b):  # vhaddps: per 128-bit lane, a0+a1, a2+a3, b0+b1, b2+b3
        mask = ir.VectorType(I32, 8)
        evens = builder.shuffle_vector(a, b, ir.Constant(mask, [0, 2, 8, 10, 4, 6, 12, 14]))
        odds = builder.shuffle_vector(a, b, ir.Constant(mask, [1, 3, 9, 11, 5, 7, 13, 15]))
        return builder.fadd(evens, odds)

    folded = [builder.fadd(half(v, 0), half(v, 1)) for v in vectors]
    folded += [ir.Constant(eight, [0.0] * 8)] * (4 - len(folded))
    both = pairwise(pairwise(folded[0], folded[1]), pairwise(folded[2], folded[3]))
    quarter = ir.VectorType(I32, 4)
    total = builder.fadd(builder.shuffle_vector(both, both, ir.Constant(quarter, [0, 1, 2, 3])),
                         builder.shuffle_vector(both, both, ir.Constant(quarter, [4, 5, 6, 7])))
    return builder.shuffle_vector(total, total, ir.Constant(I32X16, [i % 4 for i in range(LANES)]))


def splat(builder, scalar):
    """A <16 x float> of one float32 (or float64, narrowed) value."""
    if scalar.type != F32:
        scalar = builder.fptrunc(scalar, F32)
    one = builder.insert_element(ir.Constant(F32X16, ir.Undefined), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(F32X16, ir.Undefined), ir.Constant(I32X16, [0] * LANES))


def zero_accumulators(builder, count):
    return [cgutils.alloca_once_value(builder, ir.Constant(F32X16, [0.0] * LANES)) for _ in range(count)]


def or_current(builder, blocks, current):
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


def prefetch_each(builder, blocks, offset):
    """Prefetch block + offset for each of the two block addresses (far ahead into L2, and again
    nearer into L1, or into L2 where NEAR_INTO_L1 says so: kernels/prefetch.py)."""
    for near, block in enumerate(blocks):
        emit_prefetch(builder, builder.add(block, offset), into_l1=bool(near) and prefetch.NEAR_INTO_L1)


def prefetch_lines(builder, blocks, offset, nbytes):
    """:func:`prefetch_each` of every line in offset .. offset + nbytes - 1 of the blocks (offset
    on a line, nbytes a multiple of 64): a run of the blocks ahead in memory order."""
    for line in range(0, nbytes, CACHE_LINE):
        prefetch_each(builder, blocks, builder.add(offset, ir.Constant(I64, line)))


def prefetch_line(builder, blocks, offset, row_offset):
    """:func:`prefetch_each` once per 64 bytes of a row read in chunks under 64 bytes: only where
    the chunk starts at a multiple of 64 bytes into its row (``row_offset``), not 2-4 times per
    line. (Chunks of 64 bytes or more make whole lines of every step's share: prefetch_share in
    kernels/_score_tiles.py.)"""
    line_start = builder.icmp_unsigned("==", builder.and_(row_offset, ir.Constant(I64, 63)),
                                       ir.Constant(I64, 0))
    with builder.if_then(line_start):
        prefetch_each(builder, blocks, offset)


def _load_f16(builder, address, lanes=LANES):
    """``lanes`` float16 numbers at address, widened to float32."""
    return builder.fpext(load(builder, address, ir.VectorType(ir.HalfType(), lanes)),
                         ir.VectorType(F32, lanes))


def _load_bf16_wide(builder, address, lanes=LANES):
    """``lanes`` bfloat16 numbers at address, widened to float32: each 16-bit pattern shifted into
    the top of a 32-bit lane (vpmovzxwd, vpslld), exact."""
    wide = ir.VectorType(I32, lanes)
    bits = builder.zext(load(builder, address, ir.VectorType(I16, lanes)), wide)
    return builder.bitcast(builder.shl(bits, ir.Constant(wide, [16] * lanes)), ir.VectorType(F32, lanes))


def load_bf16_pairs(builder, address):
    """The PAIR_BLOCK bfloat16 numbers at address as float32, exactly, in pair order: (even
    dims, odd dims), two <8 x float>. Each 32-bit word holds an even dim in its low half and the
    next odd dim in its high half: shifted left 16 bits it is the even one, masked the odd."""
    words = load(builder, address, ir.VectorType(I32, PAIR_BLOCK // 2))
    half = ir.VectorType(F32, PAIR_BLOCK // 2)
    evens = builder.shl(words, ir.Constant(words.type, [16] * (PAIR_BLOCK // 2)))
    odds = builder.and_(words, ir.Constant(words.type, [0xFFFF0000] * (PAIR_BLOCK // 2)))
    return builder.bitcast(evens, half), builder.bitcast(odds, half)


def _load_e4m3_wide(builder, address, lanes=LANES):
    """``lanes`` float8 E4M3 numbers at address, widened to float32, exactly (NaN kept)."""
    bytes_ = load(builder, address, ir.VectorType(ir.IntType(8), lanes))
    return e4m3_to_f32(builder, builder.zext(bytes_, ir.VectorType(I16, lanes)))


# Bytes per element of each FMA tile storage.
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
_WIDEN = {"float16": _load_f16, "bfloat16": _load_bf16_wide, "float8_e4m3fn": _load_e4m3_wide}


def load_wide(builder, address, storage, lanes=LANES):
    """``lanes`` numbers of ``storage`` (a key of ELEMENT_BYTES) at address as float32."""
    if storage == "float32":
        return load(builder, address, ir.VectorType(F32, lanes))
    return _WIDEN[storage](builder, address, lanes)


def join(builder, low, high):
    """One vector of two of half its length (<8 x float> to <16 x float>, <16 x i16> to <32 x
    i16>): low in the lower lanes, high in the upper."""
    lanes = 2 * low.type.count
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, lanes), list(range(lanes))))


def load_bf16(builder, address, width):
    """``width`` (32 or 16) bfloat16 bits at address as a <32 x i16>, zeros above a 16-wide load."""
    if width == PAIRS:
        return load(builder, address, I16X32)
    half = load(builder, address, ir.VectorType(I16, LANES))
    return builder.shuffle_vector(half, ir.Constant(ir.VectorType(I16, LANES), [0] * LANES),
                                  ir.Constant(ir.VectorType(I32, PAIRS), list(range(PAIRS))))


def _e4m3_bf16_bits(byte):
    """The bfloat16 bit pattern of the E4M3 number ``byte`` (0-127: no sign), exact (3 significant
    bits, exponents -9 to 8); NaN as bfloat16's quiet NaN."""
    exponent, mantissa = byte >> 3, byte & 7
    if byte == E4M3_NAN:
        return 0x7FC0
    value = math.ldexp(mantissa + (8 if exponent else 0), max(exponent, 1) - 10)
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


_E4M3_BF16 = [_e4m3_bf16_bits(byte) for byte in range(128)]


def _e4m3_bf16_bytes(builder, bytes_):
    """The bfloat16 bit patterns of 64 E4M3 numbers (<64 x i8>), exact, NaN kept, as their low
    bytes and their high bytes (two <64 x i8>).

    With AVX512-VBMI each is one vpermi2b, a lookup of the byte's low 7 bits in a 128-byte table,
    and the sign is or-ed into the high bytes (vpternlog): 3 instructions per 64 numbers, where
    the arithmetic way (shifts, an exponent add, a table for subnormals, a NaN test; not built)
    would take ~10 per 32. Elsewhere (the tests' portable form) through float32
    (:func:`e4m3_to_f32`), whose top 16 bits are the bfloat16."""
    if HAS_AVX512_VBMI:
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I8X64, [I8X64] * 3),
                                                 "llvm.x86.avx512.vpermi2var.qi.512")

        def look_up(table):
            return builder.call(permute, [ir.Constant(I8X64, table[:64]), bytes_,
                                          ir.Constant(I8X64, table[64:])])

        low = look_up([bits & 0xFF for bits in _E4M3_BF16])
        high = look_up([bits >> 8 for bits in _E4M3_BF16])
        return low, builder.or_(high, builder.and_(bytes_, ir.Constant(I8X64, [0x80] * 64)))
    wide = ir.VectorType(I32, 64)
    bits = builder.lshr(builder.bitcast(e4m3_to_f32(builder, builder.zext(bytes_, ir.VectorType(I16, 64))),
                                        wide), ir.Constant(wide, [16] * 64))
    return (builder.trunc(bits, I8X64),
            builder.trunc(builder.lshr(bits, ir.Constant(wide, [8] * 64)), I8X64))


def e4m3_words(builder, rows, width, picks):
    """E4M3 rows as bfloat16 bit patterns, picked into <32 x i16> vectors.

    rows : the addresses of up to 64 // width rows of ``width`` (16 or 32) bytes each (None: a
    row of zeros), taken as one run of bytes, row i at i * width. picks : one list of 32 indices
    into that run per vector returned (None: a zero word). The run is converted once
    (:func:`_e4m3_bf16_bytes`) and each vector is one two-source byte permute (vpermt2b) of
    its low and high bytes."""
    byte_row = ir.VectorType(I8, width)
    run = [load(builder, row, byte_row) if row is not None else ir.Constant(byte_row, [0] * width)
           for row in rows]
    while len(run) > 1 or run[0].type.count < 64:
        if len(run) % 2:
            run.append(ir.Constant(run[0].type, [0] * run[0].type.count))
        run = [join(builder, run[i], run[i + 1]) for i in range(0, len(run), 2)]
    low, high = _e4m3_bf16_bytes(builder, run[0])
    words = []
    for pick in picks:
        mask = [index for p in pick for index in ((0, 64) if p is None else (p, 64 + p))]
        word_bytes = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 64), mask))
        vector = builder.bitcast(word_bytes, I16X32)
        if None in pick:
            kept = ir.Constant(ir.VectorType(ir.IntType(1), PAIRS), [p is not None for p in pick])
            vector = builder.select(kept, vector, ir.Constant(I16X32, [0] * PAIRS))
        words.append(vector)
    return words


def row_words(builder, rows, storage, width):
    """Rows of a vdpbf16ps storage (PAIR_BYTES) at the addresses ``rows``, ``width`` (32 or 16)
    elements of each, as one <32 x i16> of bfloat16 bits per row, zeros above a 16-wide row."""
    if storage == PAIRED:
        return [load_bf16(builder, row, width) for row in rows]
    words = []
    for first in range(0, len(rows), 64 // width):  # the rows of each 64 bytes, converted at once
        group = rows[first:first + 64 // width]
        words += e4m3_words(builder, group, width, [
            [i * width + d if d < width else None for d in range(PAIRS)] for i in range(len(group))])
    return words


def over_head_dim(builder, head_dim, step):
    """Call step(byte offset, width) for each 32-element chunk of a bfloat16 row of head_dim
    elements, then once with width 16 if head_dim % 32 == 16 (head_dim 80, 112)."""
    chunks = builder.lshr(head_dim, ir.Constant(I64, 5))
    with cgutils.for_range(builder, chunks) as loop:
        step(builder.mul(loop.index, ir.Constant(I64, PAIRS * 2)), PAIRS)
    tail = builder.icmp_unsigned("!=", builder.and_(head_dim, ir.Constant(I64, LANES)), ir.Constant(I64, 0))
    with builder.if_then(tail):
        step(builder.mul(chunks, ir.Constant(I64, PAIRS * 2)), LANES)


def multiply_add(builder, acc, a, b):
    """acc + a * b, fused, for <16 x float> vectors."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32X16, [F32X16] * 3),
                                        "llvm.fma.v16f32")
    return builder.call(fn, [a, b, acc])


def rows_switch(builder, rows, emit):
    """emit(n) under ``rows == n`` for n = 4, 3, 2, 1: one intrinsic holds the tiles of every row
    count the page loops take (4-row tiles, then one of 3, 2 or 1 rows for the rest)."""
    for n in range(MAX_ROWS, 0, -1):
        with builder.if_then(builder.icmp_signed("==", rows, ir.Constant(rows.type, n))):
            emit(n)


def score_tile(emit, doc):
    """A Numba intrinsic with the score tiles' arguments (rows, q_base, q_stride, k_base,
    k_stride, head_dim, scale, out, out_stride, pf_base, again_base) whose code is
    ``emit(builder, args)``, the integer arguments as 64-bit integers."""
    @intrinsic
    def tile(typingctx, rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out, out_stride,
             pf_base, again_base):
        signature = types.void(rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out,
                               out_stride, pf_base, again_base)

        def codegen(context, builder, sig, args):
            emit(builder, [context.cast(builder, value, ty, types.int64)
                           if isinstance(ty, types.Integer) else value
                           for value, ty in zip(args, sig.args)])
            return context.get_dummy_value()

        return signature, codegen

    tile.__doc__ = doc
    return tile


def transposed(builder, rows):
    """The 16 x 16 transpose of 16 <16 x i32> rows: out[k][n] = rows[n][k]. Four rounds, each
    swapping one bit of the row index with the same bit of the lane index by two-source
    shuffles of row pairs (64 shuffles in all)."""
    for bit in (1, 2, 4, 8):
        low = [m if not m & bit else LANES + m - bit for m in range(LANES)]
        high = [m + bit if not m & bit else LANES + m for m in range(LANES)]
        swapped = list(rows)
        for v in range(LANES):
            if not v & bit:
                a, b = rows[v], rows[v | bit]
                swapped[v] = builder.shuffle_vector(a, b, ir.Constant(I32X16, low))
                swapped[v | bit] = builder.shuffle_vector(a, b, ir.Constant(I32X16, high))
        rows = swapped
    return rows
