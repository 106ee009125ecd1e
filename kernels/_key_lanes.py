"""Score tiles with the keys along the lanes: prefill's scores of any number of query rows
against 16 consecutive key rows, with no lane-sum tree. ``KEY_LANE_TILES[storage]`` is one Numba
intrinsic per storage (kernels/_tile_ir.py): bfloat16 queries and bfloat16 or float8 key rows by
vdpbf16ps (``PAIRED``, ``PAIRED_FLOAT8``), or float32 queries and float32, float16, bfloat16 or
float8 key rows by FMAs.

The other score tiles (kernels/_score_tiles.py) put a row's dimensions along the lanes and sum
each accumulator's lanes at the end: a tree of shuffles per tile, and each step reloads the
query rows. Here the 16 key rows are transposed once into a stack scratch, so that vector j
holds dimension pair j (dims 2j, 2j + 1; vdpbf16ps) or dimension j (FMA) of the 16 keys, one key
per lane; then each query row keeps one accumulator of 16 scores, and a step multiplies vector
j by the row's pair or dimension j broadcast to every lane: one instruction per 32 (16)
products, its query operand a 32-bit broadcast load. The accumulator's lanes are the row's 16
scores in order, stored as they are. From L1 (AMD Zen 4, 64-128 query rows, head_dim 128) the
vdpbf16ps loop runs at 3.1-3.4 G instructions per second against a peak of ~3.5, where the
4-row tiles of 8 keys ran at 2.3-2.6.

The transpose costs 64 shuffles per 16 vectors, whatever the number of rows, so it pays where
many query rows share the keys — chunked prefill's 16 query tokens (32 for MHA) times the GQA
group (page_loops.py, KEY_LANE_ROWS) — and not in decode (4 rows at S1: a shuffle per
vdpbf16ps).
The FMA tiles' lane sums cost them less (a tree per 16 dims, not 32), and so do the key lanes'
gains: from L1, float32, key-lane / 4 x 4 tile time 0.69-0.97 at 64-128 rows, 0.78-1.02 at 32.
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils

from pagekv.kernels._tile_ir import (
    CACHE_LINE, ELEMENT_BYTES, F32, F32X16, I16, I32, I32X16, I64, LANES, PAIR_BYTES, PAIRS, dot_pairs,
    load_wide, multiply_add, or_current, prefetch_each, prefetch_line, row_words, score_tile, splat,
    zero_accumulators)

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


def _query_lanes(builder, address, storage):
    """The query's word at address in every lane: a bfloat16 pair as <32 x i16> (vdpbf16ps), or
    a float32 as <16 x float> (the FMA tiles' queries are float32 for any storage)."""
    if storage in ELEMENT_BYTES:
        return splat(builder, builder.load(builder.inttoptr(address, F32.as_pointer()), align=4))
    word = builder.load(builder.inttoptr(address, I32.as_pointer()), align=4)
    one = builder.insert_element(ir.Constant(I32X16, ir.Undefined), word, ir.Constant(I32, 0))
    every = builder.shuffle_vector(one, ir.Constant(I32X16, ir.Undefined), ir.Constant(I32X16, [0] * LANES))
    return builder.bitcast(every, ir.VectorType(I16, PAIRS))


def _emit(builder, storage, rows, q_first, q_step, k_first, k_step, dims, factor, out_base, out_step,
          pf, again):
    fma = storage in ELEMENT_BYTES
    # One transposed vector per dim (FMA) or per pair of dims (vdpbf16ps); a block is 16 of them,
    # the same 16 dims of every key row (FMA) or 32 (vdpbf16ps, and a last 16 if head_dim % 32).
    per_vector = 1 if fma else 2
    block_dims = LANES * per_vector
    row_bytes = block_dims * (ELEMENT_BYTES[storage] if fma else PAIR_BYTES[storage])
    keys_t = cgutils.alloca_once(builder, ir.ArrayType(I32X16, MAX_HEAD_DIM // per_vector))
    slots = builder.bitcast(keys_t, I32X16.as_pointer())
    blocks = or_current(builder, [pf, again], k_first)

    def transpose_block(offset, index, whole):
        """A block of the 16 key rows, bytes offset .. of each, into vectors index .. index + 15
        (the first 8 of them with ``whole`` false), prefetching the same bytes of the blocks
        ahead (each line once). Each row's block becomes 16 32-bit words: 16 dims widened to
        float32 (FMA), or 32 dims as bfloat16 pairs (with ``whole`` false 16 dims, as the first 8
        words and zeros above)."""
        addresses = []
        for t in range(KEYS):
            row = builder.add(builder.mul(k_step, ir.Constant(I64, t)), offset)
            if row_bytes >= CACHE_LINE:
                prefetch_each(builder, blocks, row)
            else:
                prefetch_line(builder, blocks, row, offset)
            addresses.append(builder.add(k_first, row))
        words = ([load_wide(builder, address, storage) for address in addresses] if fma else
                 row_words(builder, addresses, storage, PAIRS if whole else LANES))
        words = [builder.bitcast(word, I32X16) for word in words]
        for c, column in enumerate(_transpose(builder, words)[:LANES if whole else LANES // 2]):
            builder.store(column, builder.gep(slots, [builder.add(index, ir.Constant(I64, c))]),
                          align=64)

    block_count = builder.udiv(dims, ir.Constant(I64, block_dims))
    with cgutils.for_range(builder, block_count) as loop:
        transpose_block(builder.mul(loop.index, ir.Constant(I64, row_bytes)),
                        builder.mul(loop.index, ir.Constant(I64, LANES)), True)
    if not fma:  # a last 16 dims: 8 pairs
        tail = builder.icmp_unsigned("!=", builder.and_(dims, ir.Constant(I64, LANES)),
                                     ir.Constant(I64, 0))
        with builder.if_then(tail):
            transpose_block(builder.mul(block_count, ir.Constant(I64, row_bytes)),
                            builder.mul(block_count, ir.Constant(I64, LANES)), False)

    vectors = builder.udiv(dims, ir.Constant(I64, per_vector))
    scale = splat(builder, factor)

    def row_tile(n, r):
        """Scores of query rows r .. r + n - 1 against the 16 keys."""
        sums = zero_accumulators(builder, n)
        q_rows = [builder.add(q_first, builder.mul(q_step, builder.add(r, ir.Constant(I64, i))))
                  for i in range(n)]
        with cgutils.for_range(builder, vectors) as loop:
            keys = builder.load(builder.gep(slots, [loop.index]), align=64)
            keys = builder.bitcast(keys, F32X16 if fma else ir.VectorType(I16, PAIRS))
            word_offset = builder.mul(loop.index, ir.Constant(I64, 4))
            for i in range(n):
                query = _query_lanes(builder, builder.add(q_rows[i], word_offset), storage)
                acc = builder.load(sums[i])
                acc = multiply_add(builder, acc, keys, query) if fma else dot_pairs(builder, acc, keys, query)
                builder.store(acc, sums[i])
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


def _make_key_lane_tile(storage):
    """The key-lane tile of one storage (kernels/_tile_ir.py): bfloat16 queries and bfloat16 (or
    float8, turned into bfloat16) key rows by vdpbf16ps (``PAIRED``, ``PAIRED_FLOAT8``), or
    float32 queries and float32, float16, bfloat16 or float8 key rows, widened
    as they are loaded, by FMAs."""
    return score_tile(lambda builder, args: _emit(builder, storage, *args),
                      f"Scores of ``rows`` (any number) query rows against 16 consecutive {storage} "
                      "key rows (head_dim a multiple of 16, at most MAX_HEAD_DIM), times scale: "
                      "out + r * out_stride holds row r's 16 (float32). The same rows of the "
                      "blocks at pf_base and again_base are prefetched (0: none).")


KEY_LANE_TILES = {storage: _make_key_lane_tile(storage) for storage in (*PAIR_BYTES, *ELEMENT_BYTES)}
