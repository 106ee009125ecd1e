"""Score tiles: the scores of 1-4 query rows against 8, 4 or 1 consecutive key rows of a page block.

``SCORE_TILES[storage]`` is the pair (four keys, one key) of Numba intrinsics for one storage
(kernels/_tile_ir.py), and ``EIGHT_KEYS[storage]`` prefill's vdpbf16ps tile of eight keys: a register
tile of rows x keys accumulators, summed across lanes together at the end (one tree of shuffles
for the whole tile, not one per dot product; two for more than 16 scores), scaled and stored one
row at a time. vdpbf16ps tiles take bfloat16 queries (``PAIRED``); FMA tiles take float32
queries and float32, float16 or bfloat16 key rows, widened as they are loaded. While they read
their key rows, the tiles prefetch the same rows of two blocks ahead (kernels/prefetch.py).
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import cgutils

# The register budget (ACCUMULATORS, PAIR_ORDER) is read from the module as each tile compiles,
# so a test can compile the tiles for another CPU's budget.
from pagekv.kernels import _tile_ir as tile_ir
from pagekv.kernels._tile_ir import (
    CACHE_LINE, ELEMENT_BYTES, F32, F32X16, I16, I32, I64, LANES, PAIR_BLOCK, PAIR_BYTES, PAIRED,
    PAIRED_FLOAT8, PAIRS, dot_pairs, e4m3_words, four_sums, join, lane_sums, load, load_bf16,
    load_bf16_pairs, load_wide, multiply_add, or_current, over_head_dim, prefetch_line,
    prefetch_lines, rows_switch, row_words, score_tile, splat, zero_accumulators)


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
    return min(tokens, max(1, tile_ir.ACCUMULATORS // rows) * (2 if halves else 1))


def _reduce(builder, sums, rows, tokens, halves, avx2):
    """The scores of a tile's accumulators ``sums`` (vector r * vectors + j: row r's key j, or
    with ``halves`` its keys 2j and 2j + 1), as (one or two <16 x float>, {score r * tokens + t:
    its lane in the first or, from 16 on, the second}).

    More than 16 scores (an 8-key tile of 3-4 rows) take two trees, one per half of the keys."""
    if avx2 and not halves and len(sums) <= 4:  # AVX2 without halves
        return [four_sums(builder, sums)], {i: i for i in range(len(sums))}
    if not halves:
        order = _score_order(rows, tokens)
        total, lane_at = lane_sums(builder, [sums[i] for i in order])
        return [total], {order[position]: lane for position, lane in lane_at.items()}
    vectors = len(sums) // rows
    groups = ([list(range(len(sums)))] if len(sums) <= LANES // 2 else
              [[r * vectors + j for r in range(rows) for j in part]
               for part in (range(vectors // 2), range(vectors // 2, vectors))])
    totals, lane_of = [], {}
    for tree, group in enumerate(groups):
        total, lane_at = lane_sums(builder, [sums[v] for v in group], halves=True)
        totals.append(total)
        for position, v in enumerate(group):  # vector v's halves are scores 2v and 2v + 1
            for h in range(2):
                lane_of[2 * v + h] = LANES * tree + lane_at[2 * position + h]
    return totals, lane_of


def _make_qk_tile(tokens, *, storage=PAIRED):
    """Tiles of rows x tokens scores, rows (1-4) the first argument, head_dim a multiple of 16:
    bfloat16 queries and bfloat16 key rows (``storage=PAIRED``) or float8 ones turned into
    bfloat16 as they are loaded (``PAIRED_FLOAT8``) by vdpbf16ps, or float32 queries and
    float32, float16 or bfloat16 key rows (widened as they are loaded) by FMAs; with bfloat16
    keys and PAIR_ORDER the query rows are in pair order (kernels/_tile_rows.py).

    FMA tiles on CPUs with 16 vector registers (AVX2: ACCUMULATORS < 16) put two key rows in each
    accumulator, 8 dimensions of each (``halves``): a 4-row tile then keeps 2 keys x 4 rows in 8
    registers and loads each query chunk once for both keys. With one key row per accumulator
    it kept 1 key x 4 rows, loaded 10 vectors per 8 multiply-adds and reduced 4 accumulators
    per key (scores from L1 at ~1 cycle per multiply-add, against ~0.55 for the value tile).
    A one-row tile (MHA, a GQA group's last row) keeps one key per accumulator all the same:
    4 keys in 8 registers are 8 independent chains of multiply-adds, where two keys per
    accumulator were 4 chains, each waiting on its last FMA (S3 bfloat16 decode from L2 0.93x
    the time, AMD EPYC Zen 3, separate processes alternating); its 4 sums take
    :func:`four_sums`. Tiles of 8 keys (``EIGHT_KEYS``) always put two keys in each accumulator.
    """
    fma = storage in ELEMENT_BYTES

    def emit(builder, rows, q_first, q_step, k_first, k_step, dims, factor, out_base, out_step, *pf):
        halves = tokens == 8 or (fma and tile_ir.ACCUMULATORS < 16 and tokens > 1 and rows > 1)
        per_pass = _keys_per_pass(rows, tokens, halves) if fma else tokens
        pf = or_current(builder, pf, k_first)
        for first in range(0, tokens, per_pass):
            keys = min(per_pass, tokens - first)
            skip = builder.mul(k_step, ir.Constant(I64, first))
            pf_rows = [builder.add(block, skip) for block in pf]  # this pass's rows of the blocks ahead
            emit_pass(builder, rows, keys, halves, q_first, q_step, builder.add(k_first, skip), k_step,
                      dims, factor, builder.add(out_base, ir.Constant(I64, 4 * first)), out_step,
                      *pf_rows)

    def emit_pass(builder, rows, tokens, halves, q_first, q_step, k_first, k_step, dims, factor,
                  out_base, out_step, *pf):
        """The scores of ``rows`` query rows against ``tokens`` key rows, in one walk of head_dim."""
        per_vector = 2 if halves else 1  # key rows per accumulator
        vectors = tokens // per_vector
        sums = zero_accumulators(builder, rows * vectors)
        dot = multiply_add if fma else dot_pairs
        key_bytes = ELEMENT_BYTES[storage] if fma else PAIR_BYTES[storage]

        # The FMA tiles prefetch by shares only with AVX2's register budget, where the shares
        # were measured (below); with AVX-512's each key row asks for its own line, as the Intel
        # Xeon was measured with: there the shares read float32 decode from memory 3-8% slower
        # (AMD Zen 4, processes alternating, row lines ÷ shares time: S1 0.95-0.96, S2 0.92-0.97,
        # S3 0.96-1.00, G3 0.97, G8 0.98; float16 0.98-0.99; prefill 0.96-1.02; from L2
        # 1.05-1.09, but decode reads memory). The vdpbf16ps tiles keep the shares (row lines:
        # 1.03-1.05x the time).
        by_shares = not fma or tile_ir.ACCUMULATORS < 16

        def share_is_whole_lines(chunk_bytes):
            """Whether a step prefetches its share of the pass's rows (:func:`prefetch_share`):
            where the tiles prefetch by shares and a step's chunks of the rows make whole
            lines; else each row its own line (:func:`key_row`) - one or the other, never both."""
            return by_shares and (tokens * chunk_bytes) % CACHE_LINE == 0

        def key_row(t, key_offset, chunk_bytes):
            """The address of key row t's chunk at key_offset; when a step reads less than whole
            lines of the pass's rows, the same line of the blocks ahead is prefetched
            (:func:`prefetch_line`; else :func:`prefetch_share`)."""
            row = builder.add(builder.mul(k_step, ir.Constant(I64, t)), key_offset)
            if not share_is_whole_lines(chunk_bytes):
                prefetch_line(builder, pf, row, key_offset)
            return builder.add(k_first, row)

        def prefetch_share(key_offset, chunk_bytes):
            """This step's share of the pass's rows in the blocks ahead, in memory order: the
            step at key_offset of each row prefetches bytes key_offset * tokens onwards (whole
            lines; the rows are consecutive). Each row's own line instead made the pass's 2-4
            rows interleaved streams 256 bytes apart (head_dim 128, bfloat16). AMD EPYC Zen 3,
            processes alternating, from memory: MHA with 8 heads x 128 (16 x 2,048 tokens)
            0.78-0.88x the time, G8 0.88-0.96x, S1/S2/S3 0.90-1.06x; from L2 0.95-1.03x."""
            if share_is_whole_lines(chunk_bytes):
                prefetch_lines(builder, pf, builder.mul(key_offset, ir.Constant(I64, tokens)),
                                tokens * chunk_bytes)

        def multiply(offset, width, key_offset=None):
            """One chunk of every row: bytes ``offset`` into the query rows, ``key_offset`` (if
            not the same) into the key rows; ``width`` elements of each row (with halves: 8
            floats, or 16 bfloat16 for vdpbf16ps)."""
            key_offset = offset if key_offset is None else key_offset
            keys_of_chunk = []
            chunk_bytes = width * key_bytes if fma or halves else PAIRS * key_bytes
            prefetch_share(key_offset, chunk_bytes)
            if not fma and not halves:  # one vector per key row
                keys_of_chunk = row_words(builder, [key_row(j, key_offset, chunk_bytes)
                                                    for j in range(vectors)], storage, width)
            for j in range(vectors if fma or halves else 0):
                if halves:
                    pair = [key_row(2 * j + h, key_offset, chunk_bytes) for h in range(2)]
                    if storage == PAIRED_FLOAT8:  # the two rows' 16 numbers in one conversion
                        keys_of_chunk += e4m3_words(builder, pair, width, [list(range(PAIRS))])
                        continue
                    pair = ([load_wide(builder, row, storage, width) for row in pair] if fma else
                            [load(builder, row, ir.VectorType(I16, width)) for row in pair])
                    keys_of_chunk.append(join(builder, *pair))
                else:
                    keys_of_chunk.append(load_wide(builder, key_row(j, key_offset, chunk_bytes), storage))
            for r in range(rows):
                address = builder.add(q_first, builder.add(builder.mul(q_step, ir.Constant(I64, r)), offset))
                if halves:
                    half = load(builder, address, ir.VectorType(F32 if fma else I16, width))
                    query = join(builder, half, half)
                elif fma:
                    query = load(builder, address, F32X16)
                else:
                    query = load_bf16(builder, address, width)
                for j, key in enumerate(keys_of_chunk):
                    s = sums[r * vectors + j]
                    builder.store(dot(builder, builder.load(s), query, key), s)

        def multiply_pairs(offset):
            """One PAIR_BLOCK of every row in pair order (bfloat16 keys): ``offset`` bytes into
            the query rows (float32, in pair order), half that into the key rows."""
            key_offset = builder.lshr(offset, ir.Constant(I64, 1))
            prefetch_share(key_offset, PAIR_BLOCK * 2)
            pieces = [load_bf16_pairs(builder, key_row(j, key_offset, PAIR_BLOCK * 2))
                      for j in range(tokens)]  # (evens, odds) of each key row
            half = ir.VectorType(F32, PAIR_BLOCK // 2)
            for r in range(rows):
                address = builder.add(q_first, builder.add(builder.mul(q_step, ir.Constant(I64, r)), offset))
                q_halves = [load(builder, builder.add(address, ir.Constant(I64, 4 * i * (PAIR_BLOCK // 2))),
                                  half) for i in range(2)]
                for j in range(vectors):
                    if halves:  # key rows 2j and 2j + 1 side by side, the query's piece twice
                        operands = [(join(builder, pieces[2 * j][i], pieces[2 * j + 1][i]),
                                     join(builder, q_halves[i], q_halves[i])) for i in range(2)]
                    else:  # one key row: its block in one vector, as the query's
                        operands = [(join(builder, *pieces[j]), join(builder, *q_halves))]
                    s = sums[r * vectors + j]
                    acc = builder.load(s)
                    for key, query in operands:
                        acc = multiply_add(builder, acc, query, key)
                    builder.store(acc, s)

        if fma and storage == "bfloat16" and tile_ir.PAIR_ORDER:
            with cgutils.for_range(builder, builder.udiv(dims, ir.Constant(I64, PAIR_BLOCK))) as loop:
                multiply_pairs(builder.mul(loop.index, ir.Constant(I64, PAIR_BLOCK * 4)))
        elif fma or halves:  # chunks of 16 elements (8 floats, or 16 bfloat16, with halves)
            width = LANES // per_vector if fma else LANES
            with cgutils.for_range(builder, builder.udiv(dims, ir.Constant(I64, width))) as loop:
                multiply(builder.mul(loop.index, ir.Constant(I64, width * (4 if fma else 2))), width,
                         builder.mul(loop.index, ir.Constant(I64, width * key_bytes)))
        else:  # chunks of 32 elements, offsets in bfloat16 bytes (halved for float8 key rows)
            over_head_dim(builder, dims, lambda offset, width: multiply(
                offset, width, builder.udiv(offset, ir.Constant(I64, 2 // key_bytes))))
        totals, lane_of = _reduce(builder, [builder.load(s) for s in sums], rows, tokens, halves,
                                  fma and tile_ir.ACCUMULATORS < 16)
        totals = [builder.fmul(total, splat(builder, factor)) for total in totals]
        if len(totals) == 1:
            totals.append(ir.Constant(F32X16, ir.Undefined))
        row_type = ir.VectorType(F32, tokens)
        for r in range(rows):  # one store per row (one shuffle, or none for a 4 x 4 tile)
            address = builder.add(out_base, builder.mul(out_step, ir.Constant(I64, r)))
            lanes = ir.Constant(ir.VectorType(I32, tokens), [lane_of[r * tokens + t] for t in range(tokens)])
            row = builder.shuffle_vector(*totals, lanes)
            builder.store(row, builder.inttoptr(address, row_type.as_pointer()), align=4)

    return score_tile(lambda builder, args: rows_switch(builder, args[0],
                                                       lambda n: emit(builder, n, *args[1:])),
                      f"Scores of ``rows`` (1-4) query rows against {tokens} consecutive key rows "
                      f"({storage} keys, head_dim a multiple of 16), times scale: out + r * "
                      "out_stride holds row r's. The same rows of the blocks at pf_base and "
                      "again_base are prefetched (0: none, the tile's own rows again).")


# A GQA group's query rows take tiles of 4 rows, and one tile of 3, 2 or 1 for the rest: each tile
# pass loads the keys (and the value tiles interleave the values) once for all its rows, so 3 rows
# in one tile cost little more than 1. Against one-row tiles for the rest (decode, 16 x 2,048
# tokens, page 16, caches flushed, alternating rounds, time ratio old/new from memory): group 2
# (16/8 heads x 128) 1.23x (float32, ~57 GB/s roof), 8/2 x 128 float32 1.10x, 16/8 x 256 bfloat16
# 1.30x; group 3 (24/8 x 128) 1.48x in both dtypes; group 6 (12/2 x 128) 1.13-1.25x; group 7 (28/4
# x 128) 1.30-1.45x; from cache 1.3-2x. Groups 1, 4 and 5 (4 + 1) take the same tiles as before
# (0.98-1.01x).
SCORE_TILES = {
    PAIRED: (_make_qk_tile(4), _make_qk_tile(1)),
    # float8 pages by vdpbf16ps: each run of 64 bytes of key rows turned into bfloat16 by table
    # lookups (kernels/_tile_ir.py, e4m3_words), where the FMA tiles widen 16 numbers through
    # float16 in ~7 instructions and then multiply them one query row at a time.
    PAIRED_FLOAT8: (_make_qk_tile(4, storage=PAIRED_FLOAT8), _make_qk_tile(1, storage=PAIRED_FLOAT8)),
    # The float32 tiles serve prefill and decode. In prefill the score tiles were 7-29% faster
    # than Numba's own loops (which reduce each score's lanes alone) and, with the value tiles,
    # made prefill 1.4-1.7x faster in all (2K causal, head_dim 64/80/128). In decode,
    # memory-bound, the one-row tiles of MHA read 2-10% faster from memory (S3 and MHA shapes at
    # head_dim 64/80/128). With GQA's tiles decode read 5-9% slower from memory than the loops
    # while each line was prefetched once; asked for twice (kernels/prefetch.py) they read alike
    # or faster (S1/S2 0.98-1.01x the loops' time, 2 or 8 KV heads x 64: 0.82-0.97x) and compute
    # 1.1-1.5x faster from cache (group 2, then two one-row tiles per KV head: 14-15% slower at
    # head_dim 128, before the 2-row tile).
    "float32": (_make_qk_tile(4, storage="float32"), _make_qk_tile(1, storage="float32")),
    # float16 keys (and values): the float32 tiles on rows widened as they are loaded
    # (vcvtph2ps). Numba's loops, which widen element by element, held float16 decode below the
    # roof even from cache (S1 81% of ~35 GB/s); with these tiles decode is 1.07-1.45x faster
    # from memory (S1/S2/S3, groups 3 and 7) and prefill 1.15-1.38x.
    "float16": (_make_qk_tile(4, storage="float16"), _make_qk_tile(1, storage="float16")),
    # bfloat16 keys and values by the same FMA tiles, each row widened exactly as it is loaded (a
    # shift): on CPUs without AVX512-BF16 they replace the vdpbf16ps tiles, whose portable form
    # is no faster than float32 math and rounds the query and probabilities for nothing, and they
    # are the exact path (fast_bf16=False) on every CPU. pagekv.attention chooses.
    "bfloat16": (_make_qk_tile(4, storage="bfloat16"), _make_qk_tile(1, storage="bfloat16")),
    # float8 E4M3 keys and values: the same tiles, each row widened exactly through float16.
    "float8_e4m3fn": (_make_qk_tile(4, storage="float8_e4m3fn"),
                      _make_qk_tile(1, storage="float8_e4m3fn")),
}

# Prefill's vdpbf16ps tiles of 8 keys (AVX-512): each accumulator holds two keys, 16 dimensions of
# each (``halves``), so 4 rows x 8 keys fit in 16 registers; a step loads 16 dimensions of each key
# row and of each query row (set in both halves), and the 32 scores take two lane-sum trees of 8
# vectors, where two 4 x 4 tiles took two of 16: half the merges per score, half the calls. AMD
# EPYC Zen 4, processes alternating, new ÷ old time: chunked prefill (bfloat16) S1 0.955-0.963, S3
# (head_dim 64) 0.940-0.956, G3 0.964, G8 0.972. Decode keeps the 4 x 4 tiles: from cache it gained
# too (S1 0.96, S3 0.91, G8 1.01) but from memory it did not (S1 1.01-1.02, S3 1.03-1.04, G7 0.98,
# two runs). The float32 FMA tiles of 8 keys gained less in prefill (0.94-0.97) and lost in decode
# from cache (G8 1.04): not taken.
EIGHT_KEYS = {storage: _make_qk_tile(8, storage=storage) for storage in PAIR_BYTES}
