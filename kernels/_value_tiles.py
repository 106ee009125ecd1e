"""Value tiles: 1-4 accumulator rows += the probabilities of a page block's tokens x its value rows.

``VALUE_TILES[storage]`` is one Numba intrinsic per storage (kernels/_tile_ir.py). The vdpbf16ps
tiles (``PAIRED``, and ``PAIRED_FLOAT8`` for float8 rows) take two tokens per instruction: the rows
of tokens t and t + 1 are interleaved so each bfloat16 pair is (v[t, d], v[t + 1, d]) (by in-lane
unpacks, or for float8 rows the byte permutes that form the words, so an accumulator row holds
the dimensions in the order kernels/_tile_rows.py's ``value_dim`` gives), and the probabilities
arrive packed as (p[t], p[t + 1]) pairs. The FMA tiles take float32, float16, bfloat16 or float8 value rows
(widened as they are loaded) and float32 probabilities, and keep chunks of 16 floats of every
row in registers across a page's tokens (Numba's loop loaded and stored the accumulators every 4
tokens). While they read their value rows, the tiles prefetch two blocks ahead
(kernels/prefetch.py), each pass over a block its share of the block ahead in memory order.
"""

from llvmlite import ir  # type: ignore[import-untyped]
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# The register budget (ACCUMULATORS, PAIR_ORDER) is read from the module as each tile compiles,
# so a test can compile the tiles for another CPU's budget.
from pagekv.kernels import _tile_ir as tile_ir
from pagekv.kernels._tile_ir import (
    CACHE_LINE, ELEMENT_BYTES, F32, F32X16, I16, I32, I64, LANES, PAIR_BYTES, PAIRED, PAIRED_FLOAT8,
    PAIRS, ROW_REGISTERS, broadcast_pair, dot_pairs, e4m3_words, join, load, load_bf16_pairs,
    load_wide, multiply_add, or_current, over_head_dim, prefetch_each, prefetch_lines, rows_switch,
    splat, zero_accumulators)


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
    (v0[d], v1[d]): one float32 lane per d under vdpbf16ps, in the order value_dim gives
    (kernels/_tile_rows.py).

    In-lane unpacks, one cheap instruction each, rather than a two-source permute (vpermt2w) into
    the natural order of d: the 4-row value tile ran 1.14x faster so from cache (1.1-1.3x for 2-4
    rows in a C microbenchmark), bfloat16 prefill at head_dim 128 1.04-1.06x. The accumulators
    keep the unpacks' order of d, and the kernels put each output row back in order when they
    write it."""
    low, high = _unpack_masks(width)
    mask = ir.VectorType(I32, width)
    halves = [builder.shuffle_vector(v0, v1, ir.Constant(mask, m)) for m in (low, high)]
    if width == PAIRS:
        return halves
    return [builder.shuffle_vector(*halves, ir.Constant(ir.VectorType(I32, PAIRS), list(range(PAIRS))))]


def _row_pairs(builder, storage, row0, row1, width):
    """The pair vectors of :func:`_interleave` for the value rows at addresses row0 and row1
    (None: a row of zeros), ``width`` elements of each: bfloat16 rows loaded and interleaved, or
    float8 rows (``PAIRED_FLOAT8``) turned into bfloat16 and interleaved at once, both rows'
    bytes in one conversion (kernels/_tile_ir.py, e4m3_words)."""
    if storage == PAIRED_FLOAT8:
        low, high = _unpack_masks(width)
        return e4m3_words(builder, [row0, row1], width, [low, high] if width == PAIRS else [low + high])
    zeros = ir.Constant(ir.VectorType(I16, width), [0] * width)
    rows = [zeros if row is None else load(builder, row, ir.VectorType(I16, width)) for row in (row0, row1)]
    return _interleave(builder, *rows, width)


def _make_pv_tile(*, storage=PAIRED, chunk_rows=None):
    """Value tiles of ``rows`` (1-4, the first argument) accumulator rows over one block:
    bfloat16 value rows (``storage=PAIRED``) or float8 ones turned into bfloat16 as they are
    loaded (``PAIRED_FLOAT8``) by vdpbf16ps with packed probability pairs, or
    float32, float16 or bfloat16 value rows (widened as they are loaded) and float32
    probabilities by FMAs; with bfloat16 rows and PAIR_ORDER the accumulator rows are in pair
    order (kernels/_tile_rows.py). With ``chunk_rows`` (vdpbf16ps only) the tile of that many
    rows (whatever its first argument) over a chunk's blocks, listed in an array."""
    blocks = chunk_rows is not None
    # over_head_dim's offsets are bytes into a bfloat16 row; a value row's are these over this.
    row_scale = 2 // PAIR_BYTES.get(storage, 2)

    def emit(builder, rows, *args):
        if blocks:  # a chunk's blocks, their addresses and those to prefetch in int64 arrays
            (acc_first, acc_step, blocks_base, aheads_base, num_blocks, block_tokens, last_tokens,
             v_step, p_first, p_step, dims) = args
            # No blocks to prefetch (aheads_base 0): each block's own address instead.
            aheads_base = or_current(builder, [aheads_base], blocks_base)[0]
        else:
            acc_first, acc_step, v_first, v_step, p_first, p_step, n, dims = args[:8]
            pf = or_current(builder, args[8:], v_first)
            if storage in ELEMENT_BYTES:
                _values_f32(builder, rows, *args[:8], pf, storage=storage)
                return
        sums = zero_accumulators(builder, 2 * rows)

        def acc_pointer(r, half, offset):  # offset: bytes into a bfloat16 row
            base = builder.add(acc_first, builder.mul(acc_step, ir.Constant(I64, r)))
            address = builder.add(builder.add(base, builder.mul(offset, ir.Constant(I64, 2))),
                                  ir.Constant(I64, half * LANES * 4))
            return builder.inttoptr(address, F32X16.as_pointer())

        def accumulate(pair_vectors, pair):
            for r in range(rows):
                p_row = builder.add(builder.mul(p_step, ir.Constant(I64, r)),
                                    builder.mul(pair, ir.Constant(I64, 4)))
                probs = broadcast_pair(builder, builder.add(p_first, p_row))
                for half, pairs in enumerate(pair_vectors):
                    s = sums[2 * r + half]
                    builder.store(dot_pairs(builder, builder.load(s), pairs, probs), s)

        def block_pass(v_first, n, pf, first_pair, offset, width):
            """The pass's ``width`` bfloat16 of the n value rows of the block at v_first, from
            ``offset`` bytes into each; its probabilities are pairs first_pair onwards. It
            prefetches its share of the blocks ahead (pf) in memory order, as _values_f32 does.
            Prefetched in the columns it reads (the FMA tiles' old way, kept here when they
            changed), the vdpbf16ps decode from memory had fallen behind the FMA tiles on
            bfloat16 rows: AMD EPYC Zen 4, paired rounds, FMA ÷ vdpbf16ps time 0.92 (S1), 0.96
            (S2), now 0.98, 1.05; against the column prefetch, processes alternating, S1/S2/G3/
            G7/G8 0.94-1.01x the time (two runs), from L2 1.00x / 0.98x (S1 / G8)."""
            row_bytes = PAIR_BYTES[storage] * width
            offset = builder.udiv(offset, ir.Constant(I64, row_scale))  # bytes into a value row
            share = builder.mul(offset, n)  # where this pass's share of the block ahead starts
            num_pairs = builder.lshr(n, ir.Constant(I64, 1))
            with cgutils.for_range(builder, num_pairs) as loop:
                token = builder.mul(loop.index, ir.Constant(I64, 2))
                _prefetch_share(builder, pf, share, token, row_bytes, 2)
                row0 = builder.add(v_first, builder.add(builder.mul(v_step, token), offset))
                accumulate(_row_pairs(builder, storage, row0, builder.add(row0, v_step), width),
                           builder.add(first_pair, loop.index))
            odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(I64, 1)), ir.Constant(I64, 0))
            with builder.if_then(odd):  # the last token alone: its partner row may be stale bytes
                last = builder.sub(n, ir.Constant(I64, 1))
                _prefetch_share(builder, pf, share, last, row_bytes, 1)
                row0 = builder.add(v_first, builder.add(builder.mul(v_step, last), offset))
                accumulate(_row_pairs(builder, storage, row0, None, width),
                           builder.add(first_pair, num_pairs))

        def values(offset, width):
            """The pass over ``width`` bfloat16 of every value row from ``offset`` bytes into it,
            the accumulators' columns held in registers across the block (or all blocks)."""
            halves = width // LANES
            for r in range(rows):
                for half in range(halves):
                    builder.store(builder.load(acc_pointer(r, half, offset), align=4), sums[2 * r + half])
            if blocks:
                with cgutils.for_range(builder, num_blocks) as loop:
                    entry = builder.mul(loop.index, ir.Constant(I64, 8))
                    block = builder.load(builder.inttoptr(builder.add(blocks_base, entry), I64.as_pointer()))
                    ahead = builder.load(builder.inttoptr(builder.add(aheads_base, entry), I64.as_pointer()))
                    is_last = builder.icmp_unsigned("==", loop.index,
                                                    builder.sub(num_blocks, ir.Constant(I64, 1)))
                    first_pair = builder.mul(loop.index, builder.lshr(block_tokens, ir.Constant(I64, 1)))
                    block_pass(block, builder.select(is_last, last_tokens, block_tokens),
                               or_current(builder, [ahead], block), first_pair, offset, width)
            else:
                block_pass(v_first, n, pf, ir.Constant(I64, 0), offset, width)
            for r in range(rows):
                for half in range(halves):
                    builder.store(builder.load(sums[2 * r + half]), acc_pointer(r, half, offset), align=4)

        if rows > 1:
            over_head_dim(builder, dims, values)
            return
        # One row: walk the value rows in order (all of a row pair's chunks, then the next
        # pair) with the whole accumulator row in registers: up to 16 vectors, head_dim <= 256,
        # the chunk loop unrolled and guarded. Measured at S3 (MHA, page 16, three runs each):
        # the in-order walk overlaps prefetched memory better, 76-79% -> 81-84% of the roof.
        # For 2 rows (GQA) it measured alike, so 4-row tiles keep the chunk-outer walk.
        in_order = builder.icmp_unsigned("<=", dims, ir.Constant(I64, ROW_REGISTERS * LANES))
        with builder.if_else(in_order) as (short_rows, long_rows):
            with short_rows:
                _values_in_order(builder, dims, n, builder.lshr(n, ir.Constant(I64, 1)), v_first,
                                 v_step, p_first, acc_first, pf, storage)
            with long_rows:
                over_head_dim(builder, dims, values)

    if blocks:
        @intrinsic
        def chunk_tile(typingctx, rows, acc_base, acc_stride, blocks_base, aheads_base, num_blocks,
                       block_tokens, last_tokens, v_stride, p_base, p_stride, head_dim):
            signature = types.void(rows, acc_base, acc_stride, blocks_base, aheads_base, num_blocks,
                                   block_tokens, last_tokens, v_stride, p_base, p_stride, head_dim)

            def codegen(context, builder, sig, args):
                as_i64 = [context.cast(builder, value, ty, types.int64)
                          for value, ty in zip(args, sig.args)]
                emit(builder, chunk_rows, *as_i64[1:])
                return context.get_dummy_value()

            return signature, codegen

        chunk_tile.__doc__ = (
            f"acc[r] += p[r] @ v for {chunk_rows} rows over a chunk's num_blocks value blocks (their "
            "addresses an int64 array at blocks_base, block_tokens rows each, the last "
            "last_tokens), the accumulators' columns in registers across all of them; "
            "probabilities packed as bfloat16 pairs, the chunk's in order; each block's share of "
            "the block at aheads_base's entry is prefetched (aheads_base 0: none).")
        return chunk_tile

    @intrinsic
    def tile(typingctx, rows, acc_base, acc_stride, v_base, v_stride, p_base, p_stride, num_tokens,
             head_dim, pf_base, again_base):
        signature = types.void(rows, acc_base, acc_stride, v_base, v_stride, p_base, p_stride,
                               num_tokens, head_dim, pf_base, again_base)

        def codegen(context, builder, sig, args):
            rows_switch(builder, args[0], lambda n: emit(builder, n, *args[1:]))
            return context.get_dummy_value()

        return signature, codegen

    tile.__doc__ = ("acc[r] += sum over t < num_tokens of p[r, t] * v[t] for ``rows`` (1-4) rows: "
                    + (f"{storage} value rows (head_dim a multiple of 16) and float32 probabilities, "
                       "one per token." if storage in ELEMENT_BYTES else
                       f"{storage} value rows (head_dim a multiple of 16), float32 accumulators (each "
                       "row's dimensions in the order of value_dim), probabilities packed as "
                       "bfloat16 pairs.")
                    + " The same rows of the blocks at pf_base and again_base are prefetched (0: none, "
                    "the tile's own rows again).")
    return tile


def _values_in_order(builder, dims, n, num_pairs, v_first, v_step, p_first, acc_first, pf, storage):
    """acc += p @ v for one accumulator row, value rows (of a vdpbf16ps ``storage``) in memory
    order (all chunks of a row pair, then the next pair), the accumulator row in ROW_REGISTERS
    registers (head_dim <= 256); pf: the addresses of the blocks to prefetch."""
    sums = zero_accumulators(builder, ROW_REGISTERS)  # allocas with constant indices: registers
    full = builder.lshr(dims, ir.Constant(I64, 5))
    tail = builder.icmp_unsigned("!=", builder.and_(dims, ir.Constant(I64, LANES)), ir.Constant(I64, 0))
    acc = builder.inttoptr(acc_first, F32X16.as_pointer())

    def each_chunk(body):
        """body(chunk, width) for the row's chunks, unrolled: chunk c is 32 wide if c < full,
        16 wide if c == full and head_dim % 32 == 16."""
        for c in range(ROW_REGISTERS // 2):
            is_full = builder.icmp_unsigned(">", full, ir.Constant(I64, c))
            with builder.if_else(is_full) as (whole, rest):
                with whole:
                    body(c, PAIRS)
                with rest:
                    is_tail = builder.and_(tail, builder.icmp_unsigned("==", full, ir.Constant(I64, c)))
                    with builder.if_then(is_tail):
                        body(c, LANES)

    def load_acc(c, width):
        for h in range(width // LANES):
            pointer = builder.gep(acc, [ir.Constant(I64, 2 * c + h)])
            builder.store(builder.load(pointer, align=4), sums[2 * c + h])

    def store_acc(c, width):
        for h in range(width // LANES):
            pointer = builder.gep(acc, [ir.Constant(I64, 2 * c + h)])
            builder.store(builder.load(sums[2 * c + h]), pointer, align=4)

    def pair_of_rows(pair, row0, row1):
        probs = broadcast_pair(builder, builder.add(p_first, builder.mul(pair, ir.Constant(I64, 4))))

        def chunk(c, width):
            offset = ir.Constant(I64, c * PAIRS * PAIR_BYTES[storage])
            rows = []
            for row in (row0, row1):
                if row is None:  # the odd last token alone: its partner row may be stale bytes
                    rows.append(None)
                    continue
                prefetch_each(builder, pf, builder.add(row, offset))
                rows.append(builder.add(v_first, builder.add(row, offset)))
            for h, pairs in enumerate(_row_pairs(builder, storage, *rows, width)):
                s = sums[2 * c + h]
                builder.store(dot_pairs(builder, builder.load(s), pairs, probs), s)

        each_chunk(chunk)

    each_chunk(load_acc)
    with cgutils.for_range(builder, num_pairs) as loop:
        row0 = builder.mul(v_step, builder.mul(loop.index, ir.Constant(I64, 2)))
        pair_of_rows(loop.index, row0, builder.add(row0, v_step))
    odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(I64, 1)), ir.Constant(I64, 0))
    with builder.if_then(odd):
        pair_of_rows(num_pairs, builder.mul(v_step, builder.sub(n, ir.Constant(I64, 1))), None)
    each_chunk(store_acc)


def _prefetch_share(builder, pf, share, token, row_bytes, tokens):
    """Prefetch, in memory order, the lines of a pass's share of the blocks ahead (pf) that stand
    for ``tokens`` value rows from ``token`` on: the pass reads ``row_bytes`` of each row, and its
    share starts ``share`` bytes into a block, so token t's part starts share + t * row_bytes
    (taken down to a line; whole lines)."""
    ahead = builder.and_(builder.add(share, builder.mul(token, ir.Constant(I64, row_bytes))),
                         ir.Constant(I64, -CACHE_LINE))
    prefetch_lines(builder, pf, ahead, -(-tokens * row_bytes // CACHE_LINE) * CACHE_LINE)


F32_CHUNKS = 4  # 16-float chunks of a value row per pass of the float32 value tile


def _values_f32(builder, rows, acc_first, acc_step, v_first, v_step, p_first, p_step, n, dims, pf,
                *, storage):
    """acc += p @ v for ``rows`` accumulator rows of float32: F32_CHUNKS chunks of 16 floats of
    each row per pass (fewer where they would not fit in registers: ACCUMULATORS), held in
    registers across all n value rows (then head_dim's last chunks); the probabilities are
    float32, one per token (p_first + r * p_step: row r's); pf: the addresses of the blocks to
    prefetch. The value rows are of ``storage`` (a key of ELEMENT_BYTES; the narrow ones widened
    as they are loaded).

    The passes read the block in columns (a 4-row bfloat16 tile at head_dim 128: 8 passes of 32
    bytes of every row), but each pass prefetches its share of the block ahead in memory order
    (pass j of P the j-th P-th of it, a token pair's share at a time): prefetched in the columns
    the passes read, each 4 KiB block was asked for in 4 sweeps of 16 lines 256 bytes apart, and
    the memory served those streams slower. AMD EPYC Zen 3, processes alternating, from memory:
    S1 0.79-0.86x the time (bfloat16), 0.78-0.95x (float32), S2 0.78-0.83x, G7 0.82-0.95x, G8
    0.82-0.92x; S3 (one pass already) 1.00x; from L2 0.95-1.03x, prefill 0.96-0.99x."""
    value_bytes = ELEMENT_BYTES[storage]
    chunk_bytes = LANES * value_bytes
    per_pass = max(1, min(F32_CHUNKS, tile_ir.ACCUMULATORS // rows))  # chunks of each row in registers
    sums = zero_accumulators(builder, rows * per_pass)

    def acc_pointer(r, offset):
        address = builder.add(builder.add(acc_first, builder.mul(acc_step, ir.Constant(I64, r))), offset)
        return builder.inttoptr(address, F32X16.as_pointer())

    def chunks_at(offset, chunks):
        """The pass over chunks from ``offset`` bytes into the accumulator rows."""
        steps = [ir.Constant(I64, c * LANES * 4) for c in range(chunks)]
        v_steps = [ir.Constant(I64, c * chunk_bytes) for c in range(chunks)]
        v_offset = builder.udiv(offset, ir.Constant(I64, 4 // value_bytes))  # accumulators: float32
        width = chunks * chunk_bytes  # bytes of a value row this pass reads
        share = builder.mul(v_offset, n)  # where this pass's share of the block ahead starts

        def token(t, prefetch_tokens):
            """One value row's multiply-adds; before them, the pass's share of the block ahead for
            ``prefetch_tokens`` rows from token t (0: none)."""
            _prefetch_share(builder, pf, share, t, width, prefetch_tokens)
            row = builder.add(builder.mul(v_step, t), v_offset)
            values = []
            for c in range(chunks):
                address = builder.add(v_first, builder.add(row, v_steps[c]))
                if storage == "bfloat16" and tile_ir.PAIR_ORDER:  # a chunk is one block: in pair order
                    values.append(join(builder, *load_bf16_pairs(builder, address)))
                else:
                    values.append(load_wide(builder, address, storage))
            for r in range(rows):
                p_row = builder.add(builder.mul(p_step, ir.Constant(I64, r)),
                                    builder.mul(t, ir.Constant(I64, 4)))
                prob = splat(builder, builder.load(builder.inttoptr(builder.add(p_first, p_row),
                                                                     F32.as_pointer())))
                for c in range(chunks):
                    s = sums[r * per_pass + c]
                    builder.store(multiply_add(builder, builder.load(s), values[c], prob), s)

        for r in range(rows):
            for c in range(chunks):
                pointer = acc_pointer(r, builder.add(offset, steps[c]))
                builder.store(builder.load(pointer, align=4), sums[r * per_pass + c])
        # Token pairs: a pair's 2 * width bytes are whole lines (width is a multiple of 32), so
        # each line is asked for once with no test (a test per token cost 1.13x the time from L2).
        with cgutils.for_range(builder, builder.lshr(n, ir.Constant(I64, 1))) as loop:
            first = builder.shl(loop.index, ir.Constant(I64, 1))
            token(first, 2)
            token(builder.add(first, ir.Constant(I64, 1)), 0)
        odd = builder.icmp_unsigned("!=", builder.and_(n, ir.Constant(I64, 1)), ir.Constant(I64, 0))
        with builder.if_then(odd):  # the last token alone
            token(builder.sub(n, ir.Constant(I64, 1)), 1)
        for r in range(rows):
            for c in range(chunks):
                pointer = acc_pointer(r, builder.add(offset, steps[c]))
                builder.store(builder.load(sums[r * per_pass + c]), pointer, align=4)

    pass_bytes = ir.Constant(I64, per_pass * LANES * 4)
    passes = builder.udiv(dims, ir.Constant(I64, per_pass * LANES))
    with cgutils.for_range(builder, passes) as loop:
        chunks_at(builder.mul(loop.index, pass_bytes), per_pass)
    left = builder.udiv(builder.urem(dims, ir.Constant(I64, per_pass * LANES)), ir.Constant(I64, LANES))
    for chunks in range(1, per_pass):  # head_dim 80, 96, 112, ...: the last 1-3 chunks
        with builder.if_then(builder.icmp_unsigned("==", left, ir.Constant(I64, chunks))):
            chunks_at(builder.mul(passes, pass_bytes), chunks)


# Why each storage has its tiles: kernels/_score_tiles.py, SCORE_TILES.
VALUE_TILES = {storage: _make_pv_tile(storage=storage) for storage in (*PAIR_BYTES, *ELEMENT_BYTES)}
# Prefill's vdpbf16ps value tile of 8 accumulator rows (AVX-512: 16 accumulators) over all of a
# chunk's pages in one call, for the query rows of a prefill item (16 tokens x a GQA group, 32
# for MHA). 8 rows, not two tiles of 4: each token pair's value rows are loaded and interleaved
# once for 8 rows instead of twice. AMD EPYC Zen 4, processes alternating, bfloat16 chunked
# prefill over the 8-key score tiles alone: S1 0.951-0.961x the time, S3 0.965, G2 0.955, G3
# 0.954 (a first run 1.08, within its spread), G8 0.950. A chunk, not a page: the accumulators'
# columns stay in registers across the chunk instead of being loaded and stored per page. From
# L1 the 8-row tile over one 16-token block ran at 2.8 G vdpbf16ps per second, over one of 64
# tokens at 3.4 (Zen 4, head_dim 64-128); bfloat16 chunked prefill, processes alternating,
# against a tile per page: S1 0.905x the time, S3 0.896, G3 0.887, G8 0.931.
EIGHT_ROWS_CHUNK = {storage: _make_pv_tile(storage=storage, chunk_rows=8) for storage in PAIR_BYTES}
