"""A score tile with the keys along the lanes: prefill's scores of any number of query rows
against 16 consecutive bfloat16 key rows, by vdpbf16ps, with no lane-sum tree.

The other score tiles (kernels/_score_tiles.py) put a row's dimensions along the lanes and sum
each accumulator's lanes at the end: a tree of shuffles per tile, and each step reloads the
query rows. Here the 16 key rows are transposed once into a stack scratch, so that vector j
holds dimension pair j (dims 2j, 2j + 1) of the 16 keys, one key per lane; then each query row
keeps one accumulator of 16 scores, and a step multiplies vector j by the row's pair j
broadcast to every lane: one vdpbf16ps per 32 products, its query operand a 32-bit broadcast
load. The accumulator's lanes are the row's 16 scores in order, stored as they are. From L1
(AMD Zen 4, 64-128 query rows, head_dim 128) that loop runs at 3.1-3.4 G vdpbf16ps per second
against a peak of ~3.5, where the 4-row tiles of 8 keys ran at 2.3-2.6.

The transpose costs 64 shuffles per 32 dimensions of 16 keys, whatever the number of rows, so it
pays where many query rows share the keys — chunked prefill's 16 query tokens times the GQA
group (page_loops.py, KEY_LANE_ROWS) — and not in decode (4 rows at S1: a shuffle per
vdpbf16ps).
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from pagekv.kernels._tile_ir import (
    F32X16, I16, I32, I32X16, I64, LANES, PAIRS, dot_pairs, load, or_current, prefetch_each,
    splat, zero_accumulators)

KEYS = LANES  # key rows per tile: one per float32 lane
MAX_HEAD_DIM = 256  # the transposed keys' stack scratch holds this many dimensions
# Query rows per register tile: 16 accumulators of 16 scores, with room for the key vector;
# the rest in tiles of 8, 4, 2 and 1.
_ROW_TILES = (16, 8, 4, 2, 1)


def _transpose(builder, rows):
    """The 16 x 16 transpose of 16 <16 x i32> vectors: output c holds lane c of every input, input
    t in lane t. In-lane unpacks of 32-bit then 64-bit words gather 4 inputs' word c in each
    128-bit lane, then two rounds of 128-bit lane shuffles (vshufi32x4) put the 4 lanes of 4
    inputs together: 64 one-instruction shuffles. (Swapping the off-diagonal blocks of 8, 4, 2
    and 1 lanes took as many, half of them two-source permutes: vpermt2q, vpermt2d.)"""
    def shuffle(x, y, mask):  # lanes of x ++ y
        return builder.shuffle_vector(x, y, ir.Constant(I32X16, mask))

    def in_lanes(pattern):  # the same 4 picks (of x ++ y, offsets in a 128-bit lane) in every lane
        return [(16 if p >= 4 else 0) + 4 * lane + p % 4 for lane in range(4) for p in pattern]

    def lanes(first, second):  # 128-bit lanes of x, then of y
        return [16 * s + 4 * lane + i for s, pair in enumerate((first, second)) for lane in pair
                for i in range(4)]

    words = []  # words[i][h]: inputs 2i, 2i + 1 interleaved, words 2h, 2h + 1 of each lane
    for i in range(LANES // 2):
        x, y = rows[2 * i], rows[2 * i + 1]
        words.append((shuffle(x, y, in_lanes([0, 4, 1, 5])), shuffle(x, y, in_lanes([2, 6, 3, 7]))))
    columns = [[] for _ in range(4)]  # columns[e][g]: inputs 4g .. 4g + 3, word e of each lane
    for g in range(4):
        for h in range(2):
            x, y = words[2 * g][h], words[2 * g + 1][h]
            columns[2 * h].append(shuffle(x, y, in_lanes([0, 1, 4, 5])))
            columns[2 * h + 1].append(shuffle(x, y, in_lanes([2, 3, 6, 7])))
    out = [None] * LANES
    for e, (x0, x1, x2, x3) in enumerate(columns):
        d = [shuffle(x0, x1, lanes((0, 2), (0, 2))), shuffle(x0, x1, lanes((1, 3), (1, 3))),
             shuffle(x2, x3, lanes((0, 2), (0, 2))), shuffle(x2, x3, lanes((1, 3), (1, 3)))]
        out[e] = shuffle(d[0], d[2], lanes((0, 2), (0, 2)))  # word e of lane 0: column e
        out[8 + e] = shuffle(d[0], d[2], lanes((1, 3), (1, 3)))
        out[4 + e] = shuffle(d[1], d[3], lanes((0, 2), (0, 2)))
        out[12 + e] = shuffle(d[1], d[3], lanes((1, 3), (1, 3)))
    return out


def _key_words(builder, address, whole):
    """The 16 32-bit words (dimension pairs) of a key row's 32 dimensions at address, or with
    ``whole`` false its 16 dimensions there as the first 8 words and zeros above."""
    if whole:
        return load(builder, address, I32X16)
    half = load(builder, address, ir.VectorType(I32, LANES // 2))
    return builder.shuffle_vector(half, ir.Constant(half.type, [0] * (LANES // 2)),
                                  ir.Constant(I32X16, list(range(LANES))))


def _emit(builder, rows, q_first, q_step, k_first, k_step, dims, factor, out_base, out_step, pf,
          again):
    keys_t = cgutils.alloca_once(builder, ir.ArrayType(I32X16, MAX_HEAD_DIM // 2))
    slots = builder.bitcast(keys_t, I32X16.as_pointer())
    blocks = or_current(builder, [pf, again], k_first)

    def transpose_block(offset, index, whole):
        """Dims of bytes offset .. offset + 63 of the 16 key rows into vectors index .. index + 15
        (the first 8 of them with ``whole`` false: 16 dims), prefetching the same bytes of the
        blocks ahead."""
        words = []
        for t in range(KEYS):
            row = builder.add(builder.mul(k_step, ir.Constant(I64, t)), offset)
            prefetch_each(builder, blocks, row)
            words.append(_key_words(builder, builder.add(k_first, row), whole))
        for c, column in enumerate(_transpose(builder, words)[:LANES if whole else LANES // 2]):
            builder.store(column, builder.gep(slots, [builder.add(index, ir.Constant(I64, c))]),
                          align=64)

    chunks = builder.lshr(dims, ir.Constant(I64, 5))  # 32 dims: 64 bytes of a key row
    with cgutils.for_range(builder, chunks) as loop:
        transpose_block(builder.mul(loop.index, ir.Constant(I64, PAIRS * 2)),
                        builder.mul(loop.index, ir.Constant(I64, LANES)), True)
    tail = builder.icmp_unsigned("!=", builder.and_(dims, ir.Constant(I64, LANES)), ir.Constant(I64, 0))
    with builder.if_then(tail):
        transpose_block(builder.mul(chunks, ir.Constant(I64, PAIRS * 2)),
                        builder.mul(chunks, ir.Constant(I64, LANES)), False)

    pairs = builder.lshr(dims, ir.Constant(I64, 1))
    scale = splat(builder, factor)

    def row_tile(n, r):
        """Scores of query rows r .. r + n - 1 against the 16 keys."""
        sums = zero_accumulators(builder, n)
        q_rows = [builder.add(q_first, builder.mul(q_step, builder.add(r, ir.Constant(I64, i))))
                  for i in range(n)]
        with cgutils.for_range(builder, pairs) as loop:
            keys = builder.bitcast(builder.load(builder.gep(slots, [loop.index]), align=64),
                                   ir.VectorType(I16, PAIRS))
            word_offset = builder.mul(loop.index, ir.Constant(I64, 4))
            for i in range(n):
                word = builder.load(builder.inttoptr(builder.add(q_rows[i], word_offset),
                                                     I32.as_pointer()), align=4)
                one = builder.insert_element(ir.Constant(I32X16, ir.Undefined), word, ir.Constant(I32, 0))
                query = builder.bitcast(builder.shuffle_vector(
                    one, ir.Constant(I32X16, ir.Undefined), ir.Constant(I32X16, [0] * LANES)),
                    ir.VectorType(I16, PAIRS))
                builder.store(dot_pairs(builder, builder.load(sums[i]), keys, query), sums[i])
        for i in range(n):
            address = builder.add(out_base, builder.mul(out_step, builder.add(r, ir.Constant(I64, i))))
            builder.store(builder.fmul(builder.load(sums[i]), scale),
                          builder.inttoptr(address, F32X16.as_pointer()), align=4)

    whole = builder.udiv(rows, ir.Constant(I64, _ROW_TILES[0]))
    with cgutils.for_range(builder, whole) as loop:
        row_tile(_ROW_TILES[0], builder.mul(loop.index, ir.Constant(I64, _ROW_TILES[0])))
    r = builder.mul(whole, ir.Constant(I64, _ROW_TILES[0]))
    for n in _ROW_TILES[1:]:  # the rest, rows % 16, as a sum of 8, 4, 2, 1
        taken = builder.and_(rows, ir.Constant(I64, n))
        with builder.if_then(builder.icmp_unsigned("!=", taken, ir.Constant(I64, 0))):
            row_tile(n, r)
        r = builder.add(r, taken)


@intrinsic
def sixteen_keys(typingctx, rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out,
                 out_stride, pf_base, again_base):
    """Scores of ``rows`` (any number) bfloat16 query rows against 16 consecutive bfloat16 key rows
    (head_dim a multiple of 16, at most MAX_HEAD_DIM), times scale: out + r * out_stride holds
    row r's 16 (float32). The same rows of the blocks at pf_base and again_base are prefetched
    (0: none)."""
    signature = types.void(rows, q_base, q_stride, k_base, k_stride, head_dim, scale, out, out_stride,
                           pf_base, again_base)

    def codegen(context, builder, sig, args):
        as_i64 = [context.cast(builder, value, ty, types.int64) if isinstance(ty, types.Integer)
                  else value for value, ty in zip(args, sig.args)]
        _emit(builder, *as_i64)
        return context.get_dummy_value()

    return signature, codegen
