"""The loops over one page block that the attention kernels call per page: scores of a block's
keys for a block of query rows, and the probabilities times its values into their accumulators.

Two forms of each. The register tiles (kernels/_score_tiles.py, kernels/_value_tiles.py, and
for prefill's many query rows kernels/_key_lanes.py) serve head_dim a multiple of 16, in one
of six *kinds* fixed when a kernel compiles: the FMA tiles of each storage (float32, float16,
bfloat16, float8_e4m3fn) and the vdpbf16ps tiles for bfloat16 pages (``PAIRED``) and float8
pages (``PAIRED_FLOAT8``); :func:`kernel_kind` picks.
Numba's plain loops (:func:`plain_page_scores`, :func:`plain_page_accumulate`) serve any
head_dim. Both prefetch a block ahead as they read (kernels/prefetch.py). Prefill's values go a
chunk of pages at a time (:func:`tiled_page_loops`' chunk_accumulate).
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from pagekv.kernels._float8_rows import SCRATCH_BYTES, widen_block
from pagekv.kernels._dtypes import (FORMAT_BFLOAT16, FORMAT_FLOAT8_E4M3FN, FORMAT_FLOAT16,
                                    FORMAT_FLOAT32, load_f32)
from pagekv.kernels._key_lanes import KEY_LANE_TILES, KEYS, MAX_HEAD_DIM
from pagekv.kernels._math import JIT
from pagekv.kernels._score_tiles import EIGHT_KEYS, SCORE_TILES
from pagekv.kernels._tile_ir import ACCUMULATORS, LANES, MAX_ROWS, PAIR_BYTES, PAIRED, PAIRED_FLOAT8
from pagekv.kernels._value_tiles import EIGHT_ROWS_CHUNK, VALUE_TILES
from pagekv.kernels.prefetch import block_address, prefetch_rows as _prefetch_rows

# Prefill's query rows from which a page's keys take the key-lane tiles, 16 keys at a time
# (kernels/_key_lanes.py). From L1 the vdpbf16ps ones beat the 8-key tiles at any row count
# (Zen 4, one process, alternating, key-lane / 8-key time: 16 rows 0.68-0.87 at head_dim 64-128,
# 1.02-1.04 at 256; 32 rows 0.64-0.95; 128 rows 0.62-0.87), but in the kernel, where each 16 keys
# arrive from L2 into the transpose at once, MHA prefill (16 rows) took 1.07x the time (S3,
# processes alternating) against 0.91-0.93x for 32 rows and more (S1, S2). float32 prefill,
# against the 4 x 4 FMA tiles: S2 0.95, G3 0.97, G8 0.96-0.97, S1 1.00.
KEY_LANE_ROWS = 32


@njit(**JIT)
def plain_page_scores(qs, r0, num_rows, kc, kp, kh, kv_format, num_tokens, scores, col, ahead):
    """scores[r0 + r, col + t] = qs[r0 + r] . kc[kp, kh, t] for the page's tokens.

    Register blocking, so the loop is bound by multiply-adds rather than loads: four query rows
    times two key rows share each load (8 accumulators; 1.27x the speed of four rows times one key,
    from cache on S1); rows left over take four key rows at a time. While reading key rows t..,
    the same rows of the block at address ``ahead`` are prefetched (0: none), once. (Asking again
    nearer, as the tiles do, read 0.5-1.9% faster from memory here but cost 9-13% from cache.)
    """
    head_dim = qs.shape[1]
    r = r0
    while r + 4 <= r0 + num_rows:
        pf = ahead if r == r0 else 0
        t = 0
        while t + 2 <= num_tokens:
            _prefetch_rows(pf, kc.strides[2], t, 2)
            s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = np.float32(0.0)
            for d in range(head_dim):
                k0 = load_f32(kc, kp, kh, t, d, kv_format)
                k1 = load_f32(kc, kp, kh, t + 1, d, kv_format)
                q0, q1, q2, q3 = qs[r, d], qs[r + 1, d], qs[r + 2, d], qs[r + 3, d]
                s00 += q0 * k0
                s01 += q0 * k1
                s10 += q1 * k0
                s11 += q1 * k1
                s20 += q2 * k0
                s21 += q2 * k1
                s30 += q3 * k0
                s31 += q3 * k1
            scores[r, col + t], scores[r, col + t + 1] = s00, s01
            scores[r + 1, col + t], scores[r + 1, col + t + 1] = s10, s11
            scores[r + 2, col + t], scores[r + 2, col + t + 1] = s20, s21
            scores[r + 3, col + t], scores[r + 3, col + t + 1] = s30, s31
            t += 2
        if t < num_tokens:  # an odd number of tokens: the last key row
            _prefetch_rows(pf, kc.strides[2], t, 1)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for d in range(head_dim):
                k = load_f32(kc, kp, kh, t, d, kv_format)
                s0 += qs[r, d] * k
                s1 += qs[r + 1, d] * k
                s2 += qs[r + 2, d] * k
                s3 += qs[r + 3, d] * k
            scores[r, col + t], scores[r + 1, col + t] = s0, s1
            scores[r + 2, col + t], scores[r + 3, col + t] = s2, s3
        r += 4
    for r in range(r, r0 + num_rows):
        pf = ahead if r == r0 else 0
        t = 0
        while t + 4 <= num_tokens:
            _prefetch_rows(pf, kc.strides[2], t, 4)
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for d in range(head_dim):
                q = qs[r, d]
                s0 += q * load_f32(kc, kp, kh, t, d, kv_format)
                s1 += q * load_f32(kc, kp, kh, t + 1, d, kv_format)
                s2 += q * load_f32(kc, kp, kh, t + 2, d, kv_format)
                s3 += q * load_f32(kc, kp, kh, t + 3, d, kv_format)
            scores[r, col + t], scores[r, col + t + 1] = s0, s1
            scores[r, col + t + 2], scores[r, col + t + 3] = s2, s3
            t += 4
        for t in range(t, num_tokens):
            _prefetch_rows(pf, kc.strides[2], t, 1)
            s = np.float32(0.0)
            for d in range(head_dim):
                s += qs[r, d] * load_f32(kc, kp, kh, t, d, kv_format)
            scores[r, col + t] = s


@njit(**JIT)
def plain_page_accumulate(scores, r0, num_rows, col, vc, vp, vh, kv_format, num_tokens, acc, ahead):
    """acc[r0 + r] += sum over t of scores[r0 + r, col + t] * vc[vp, vh, t].

    Four value rows per pass over four accumulator rows at once: each value load feeds four
    multiply-adds and each accumulator load and store sixteen (rows left over: four value rows per
    pass over one accumulator row; the last num_tokens % 4 value rows: one at a time, every
    accumulator row). Prefetches like :func:`plain_page_scores`.
    """
    head_dim = acc.shape[1]
    r = r0
    while r + 4 <= r0 + num_rows:
        pf = ahead if r == r0 else 0
        t = 0
        while t + 4 <= num_tokens:
            _prefetch_rows(pf, vc.strides[2], t, 4)
            c = col + t
            a0, a1, a2, a3 = scores[r, c], scores[r, c + 1], scores[r, c + 2], scores[r, c + 3]
            b0, b1, b2, b3 = scores[r + 1, c], scores[r + 1, c + 1], scores[r + 1, c + 2], scores[r + 1, c + 3]
            e0, e1, e2, e3 = scores[r + 2, c], scores[r + 2, c + 1], scores[r + 2, c + 2], scores[r + 2, c + 3]
            f0, f1, f2, f3 = scores[r + 3, c], scores[r + 3, c + 1], scores[r + 3, c + 2], scores[r + 3, c + 3]
            for d in range(head_dim):
                v0 = load_f32(vc, vp, vh, t, d, kv_format)
                v1 = load_f32(vc, vp, vh, t + 1, d, kv_format)
                v2 = load_f32(vc, vp, vh, t + 2, d, kv_format)
                v3 = load_f32(vc, vp, vh, t + 3, d, kv_format)
                acc[r, d] += (a0 * v0 + a1 * v1) + (a2 * v2 + a3 * v3)
                acc[r + 1, d] += (b0 * v0 + b1 * v1) + (b2 * v2 + b3 * v3)
                acc[r + 2, d] += (e0 * v0 + e1 * v1) + (e2 * v2 + e3 * v3)
                acc[r + 3, d] += (f0 * v0 + f1 * v1) + (f2 * v2 + f3 * v3)
            t += 4
        r += 4
    for r in range(r, r0 + num_rows):
        pf = ahead if r == r0 else 0
        t = 0
        while t + 4 <= num_tokens:
            _prefetch_rows(pf, vc.strides[2], t, 4)
            c = col + t
            p0, p1, p2, p3 = scores[r, c], scores[r, c + 1], scores[r, c + 2], scores[r, c + 3]
            for d in range(head_dim):
                acc[r, d] += (p0 * load_f32(vc, vp, vh, t, d, kv_format)
                              + p1 * load_f32(vc, vp, vh, t + 1, d, kv_format)) + \
                    (p2 * load_f32(vc, vp, vh, t + 2, d, kv_format)
                     + p3 * load_f32(vc, vp, vh, t + 3, d, kv_format))
            t += 4
    for t in range(num_tokens - num_tokens % 4, num_tokens):  # the last tokens, every row
        _prefetch_rows(ahead, vc.strides[2], t, 1)
        for r in range(r0, r0 + num_rows):
            p = scores[r, col + t]
            for d in range(head_dim):
                acc[r, d] += p * load_f32(vc, vp, vh, t, d, kv_format)


def key_lane_scores(kind, num_rows, q, q_row, block, k_row, head_dim, num_tokens, scale, out, s_row,
                    ahead, again):
    """Scores of num_rows query rows (address q, q_row bytes apart) against each whole 16 of a
    block's num_tokens key rows by the key-lane tiles of ``kind`` (a compile-time constant;
    kernels/_key_lanes.py), into out; returns how many key rows were scored (num_tokens rounded
    down to 16). The same rows of the blocks at ``ahead`` and ``again`` are prefetched (0: none).

    Compiled as a function of its own (an overload, chosen by the kind), not inlined: its tile's
    stack scratch (8-16 KiB) in the page loop's frame made prefill with fewer rows, which never
    calls it, 1.10x slower (S3, Zen 4)."""
    raise NotImplementedError("called by the compiled kernels only")


@overload(key_lane_scores, prefer_literal=True)
def _key_lane_scores(kind, num_rows, q, q_row, block, k_row, head_dim, num_tokens, scale, out, s_row,
                     ahead, again):
    if not isinstance(kind, types.StringLiteral):
        return None
    tile = KEY_LANE_TILES[kind.literal_value]

    def impl(kind, num_rows, q, q_row, block, k_row, head_dim, num_tokens, scale, out, s_row, ahead,
             again):
        keyed = 0
        while keyed + KEYS <= num_tokens:
            pf = ahead + keyed * k_row if ahead != 0 else 0
            pf_again = again + keyed * k_row if again != 0 else 0
            tile(num_rows, q, q_row, block + keyed * k_row, k_row, head_dim, scale, out + keyed * 4,
                 s_row, pf, pf_again)
            keyed += KEYS
        return keyed
    return impl


def _block_loops(kind, *, key_lanes):
    """The loops over one page block by register tiles of one kind (see :func:`tiled_page_loops`),
    the block given by its address: (block_scores, block_accumulate)."""
    (four_keys, one_key), values = SCORE_TILES[kind], VALUE_TILES[kind]
    eights = key_lanes and kind in PAIR_BYTES
    eight_keys = EIGHT_KEYS[kind] if eights else four_keys  # (neither is called unless eights)
    pairs = kind in PAIR_BYTES  # probabilities packed two tokens to a word

    @njit(inline="always", **JIT)  # in page_scores
    def block_scores(q, r0, num_rows, block, k_row, head_dim, num_tokens, scale, scores, col, ahead,
                     again):
        """:func:`page_scores` of the block at address ``block`` (k_row bytes between its rows)."""
        q_row, s_row = q.strides[0], scores.strides[0]
        keyed = 0  # tokens scored by the key-lane tiles, for all rows
        if key_lanes and num_rows >= KEY_LANE_ROWS and head_dim <= MAX_HEAD_DIM:
            keyed = key_lane_scores(kind, num_rows, q.ctypes.data + r0 * q_row, q_row, block, k_row,
                                    head_dim, num_tokens, scale,
                                    scores.ctypes.data + r0 * s_row + col * 4, s_row, ahead, again)
        r = r0
        while r < r0 + num_rows and keyed < num_tokens:
            rows = min(MAX_ROWS, r0 + num_rows - r)
            q_r = q.ctypes.data + r * q_row
            out = scores.ctypes.data + r * s_row + col * 4
            t = keyed
            while t < num_tokens:
                pf = ahead + t * k_row if (ahead != 0 and r == r0) else 0
                pf_again = again + t * k_row if (again != 0 and r == r0) else 0
                k_t, out_t = block + t * k_row, out + t * 4
                if eights:
                    if t + 8 <= num_tokens:
                        eight_keys(rows, q_r, q_row, k_t, k_row, head_dim, scale, out_t, s_row, pf,
                                   pf_again)
                        t += 8
                        continue
                if t + 4 <= num_tokens:
                    four_keys(rows, q_r, q_row, k_t, k_row, head_dim, scale, out_t, s_row, pf, pf_again)
                    t += 4
                    continue
                for u in range(t, num_tokens):
                    pf_u = pf + (u - t) * k_row if pf != 0 else 0
                    again_u = pf_again + (u - t) * k_row if pf_again != 0 else 0
                    one_key(rows, q_r, q_row, block + u * k_row, k_row, head_dim, scale, out + u * 4,
                            s_row, pf_u, again_u)
                t = num_tokens
            r += rows

    @njit(inline="always", **JIT)  # in page_accumulate, and per block in chunk_accumulate
    def block_accumulate(probs, r, end, col, block, v_row, num_tokens, head_dim, acc, ahead, again):
        """acc[r:end] += probs[r:end] (from column col) times the num_tokens value rows of the
        block at address ``block`` (v_row bytes apart), by register tiles of 4 rows (3, 2 or 1 for
        the rest); the first tile prefetches the blocks at ``ahead`` and ``again`` (0: none)."""
        a_row, p_row = acc.strides[0], probs.strides[0]
        first_prob = (col // 2) * 4 if pairs else col * 4
        pf, pf_again = ahead, again
        while r < end:
            rows = min(MAX_ROWS, end - r)
            a, p = acc.ctypes.data + r * a_row, probs.ctypes.data + r * p_row + first_prob
            values(rows, a, a_row, block, v_row, p, p_row, num_tokens, head_dim, pf, pf_again)
            pf, pf_again = 0, 0
            r += rows

    return block_scores, block_accumulate


def tiled_page_loops(kind, *, inline=True, many_rows=False):
    """The page loops over register tiles of one kind, fixed when a kernel is compiled: float32,
    float16, bfloat16 or float8 pages (``kind``) by FMA tiles, or bfloat16 or float8 pages by
    vdpbf16ps tiles.

    The tiles are picked here, in Python, so each kernel compiles one kind of tiles, not both.
    ``inline`` False compiles the loops as functions of their own, called per page, not inlined
    into the kernel. ``many_rows`` (AVX-512 only) takes the tiles made for prefill's many query
    rows per page: every 16 keys of a page by the key-lane tiles where there are KEY_LANE_ROWS
    rows or more (kernels/_key_lanes.py), and with vdpbf16ps tiles, 8 keys at a time for the rest
    where a page has them (kernels/_score_tiles.py, EIGHT_KEYS) and a chunk's values into 8
    accumulator rows at a time where there are 8 (kernels/_value_tiles.py, EIGHT_ROWS_CHUNK);
    decode takes none of them.

    Returns (page_scores, page_accumulate, chunk_accumulate): decode calls the first two, page by
    page; prefill the first and the last, which takes a chunk's value blocks at once.
    """
    jit = njit(inline="always" if inline else "never", **JIT)
    key_lanes = many_rows and ACCUMULATORS >= 16  # 16 accumulators: AVX-512
    eights = key_lanes and kind in PAIR_BYTES
    eight_rows_chunk = EIGHT_ROWS_CHUNK[kind if eights else PAIRED]  # (called only if eights)
    block_scores, block_accumulate = _block_loops(kind, key_lanes=key_lanes)
    if kind == PAIRED_FLOAT8 and not many_rows:
        return widening_page_loops(jit, block_scores, block_accumulate)

    @jit
    def page_scores(q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
        """:func:`plain_page_scores` by register tiles (kernels/_score_tiles.py), head_dim a
        multiple of 16 (``kind``): bfloat16 or float8 pages by vdpbf16ps, or float32, float16,
        bfloat16 or float8 pages by FMAs.

        q : uint16 [rows, head_dim], the queries rounded to bfloat16 and not scaled (vdpbf16ps),
        or float32 (FMA); the scores are multiplied by ``scale``. Tiles of 4 query
        rows x 4 key rows (with ``many_rows``: each 16 keys for all rows at once by
        :func:`key_lane_scores` where there are KEY_LANE_ROWS rows, else 8, then 4); the rows
        left over take one tile of 3, 2 or 1 rows, the page's last num_tokens % 4 keys one key at
        a time. Each key row's lines of the blocks at addresses ``ahead`` and ``again`` (0: none)
        are prefetched by the first row tile (or the key-lane tile).
        """
        block_scores(q, r0, num_rows, block_address(kc, kp, kh), kc.strides[2], kc.shape[3],
                     num_tokens, scale, scores, col, ahead, again)

    @jit
    def page_accumulate(probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
        """:func:`plain_page_accumulate` by register tiles of 4 accumulator rows (3, 2 or 1 for
        the rest; kernels/_value_tiles.py), head_dim a multiple of 16 (``kind``): bfloat16 or
        float8 pages by vdpbf16ps, two tokens per instruction (col even), or float32, float16,
        bfloat16 or float8 pages by FMAs.

        probs : uint32 [rows, pairs], the probabilities packed by pack_pairs
        (kernels/_tile_rows.py), or float32 [rows, cols], the probabilities themselves (the scores
        array). The first row tile prefetches the blocks at addresses ``ahead`` and ``again``
        (0: none).
        """
        block_accumulate(probs, r0, r0 + num_rows, col, block_address(vc, vp, vh),
                         vc.strides[2], num_tokens, vc.shape[3], acc, ahead, again)

    @jit
    def chunk_accumulate(probs, r0, num_rows, vc, blocks, aheads, num_blocks, last_tokens, acc):
        """:func:`page_accumulate` over a chunk's num_blocks value blocks at once: their addresses
        blocks[:num_blocks], the blocks to prefetch while reading them aheads[:num_blocks] (0:
        none), each page_size value rows but the last (last_tokens); the chunk's probabilities from
        column 0. With ``many_rows`` (vdpbf16ps) each 8 accumulator rows take all the blocks in one
        tile, their columns held in registers across the chunk (EIGHT_ROWS_CHUNK); other rows
        take the value tiles block by block."""
        head_dim, page_size, v_row = vc.shape[3], vc.shape[2], vc.strides[2]
        a_row, p_row = acc.strides[0], probs.strides[0]
        r = r0
        if eights:
            while r + 8 <= r0 + num_rows:
                eight_rows_chunk(8, acc.ctypes.data + r * a_row, a_row, blocks.ctypes.data,
                                 aheads.ctypes.data if r == r0 else 0, num_blocks, page_size,
                                 last_tokens, v_row, probs.ctypes.data + r * p_row, p_row, head_dim)
                r += 8
        for b in range(num_blocks):  # the rows left, block by block
            block_accumulate(probs, r, r0 + num_rows, b * page_size, blocks[b], v_row,
                             last_tokens if b == num_blocks - 1 else page_size, head_dim, acc,
                             aheads[b] if r == r0 else 0, 0)

    return page_scores, page_accumulate, chunk_accumulate


def widening_page_loops(jit, block_scores, block_accumulate):
    """Decode's page loops over float8 pages by vdpbf16ps (``PAIRED_FLOAT8``; block_scores and
    block_accumulate from :func:`_block_loops`): a GQA group of more than MAX_ROWS query heads
    takes two row tiles per block, so its blocks are turned into bfloat16 once
    (kernels/_float8_rows.py) and read by the bfloat16 tiles (``PAIRED``); smaller groups, and
    blocks over SCRATCH_BYTES, take the float8 tiles, which turn each row as they load it.

    Returns (page_scores, page_accumulate, None): as :func:`tiled_page_loops`, for decode."""
    bf16_scores, bf16_accumulate = _block_loops(PAIRED, key_lanes=False)

    @jit
    def page_scores(q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
        """:func:`tiled_page_loops`' page_scores of float8 pages."""
        block, head_dim = block_address(kc, kp, kh), kc.shape[3]
        count = num_tokens * head_dim
        if num_rows > MAX_ROWS and 2 * count <= SCRATCH_BYTES:
            bf16_scores(q, r0, num_rows, widen_block(block, count, ahead, again), 2 * head_dim,
                        head_dim, num_tokens, scale, scores, col, 0, 0)
        else:
            block_scores(q, r0, num_rows, block, kc.strides[2], head_dim, num_tokens, scale, scores,
                         col, ahead, again)

    @jit
    def page_accumulate(probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
        """:func:`tiled_page_loops`' page_accumulate of float8 pages."""
        block, head_dim = block_address(vc, vp, vh), vc.shape[3]
        count = num_tokens * head_dim
        if num_rows > MAX_ROWS and 2 * count <= SCRATCH_BYTES:
            bf16_accumulate(probs, r0, r0 + num_rows, col, widen_block(block, count, ahead, again),
                            2 * head_dim, num_tokens, head_dim, acc, 0, 0)
        else:
            block_accumulate(probs, r0, r0 + num_rows, col, block, vc.strides[2], num_tokens, head_dim,
                             acc, ahead, again)

    return page_scores, page_accumulate, None


# The kernel kinds: the FMA tiles of each storage (kernels/_dtypes.py), and the vdpbf16ps tiles.
STORAGE = {FORMAT_FLOAT32: "float32", FORMAT_FLOAT16: "float16", FORMAT_BFLOAT16: "bfloat16",
           FORMAT_FLOAT8_E4M3FN: "float8_e4m3fn"}
KINDS = (*STORAGE.values(), *PAIR_BYTES)
_TILED = {kind: tiled_page_loops(kind) for kind in KINDS}
# Prefill's vdpbf16ps kernel calls its tile loops as functions: inlined into a kernel of its own
# (kernels/attention.py, _prefill_kernel) they ran 5-13% slower (8/2x64, 32/8x128, 16/16x64, 12
# process pairs), called they run as fast as they did inlined into the old kernel that held both
# kinds (0.99-1.01), and compile 2 s faster. Decode keeps them inlined: called, it was 6-16%
# slower from cache. The FMA kinds' prefill loops stay inlined (their key-lane tiles are called).
_PREFILL_TILED = {kind: tiled_page_loops(kind, inline=kind not in PAIR_BYTES, many_rows=True)
                  for kind in KINDS}


def kernel_kind(k_cache, kv_format, dot_products):
    """The kind of kernel that serves these pages: the vdpbf16ps tiles for bfloat16 pages
    (``PAIRED``) and float8 pages (``PAIRED_FLOAT8``) when ``dot_products`` allows and the
    shape takes them (head_dim a multiple of 16, an even page size, so every page starts on a
    packed probability pair); otherwise the storage's own FMA tiles (Numba's loops where
    head_dim is not a multiple of 16)."""
    if dot_products and k_cache.shape[3] % LANES == 0 and k_cache.shape[2] % 2 == 0:
        if kv_format == FORMAT_BFLOAT16:
            return PAIRED
        if kv_format == FORMAT_FLOAT8_E4M3FN:
            return PAIRED_FLOAT8
    return STORAGE[kv_format]

def _by_storage(loops):
    """Stand-ins for the tile loops ``loops[kind]`` (scores, values) that the kernels call with
    their storage kind first (a compile-time constant): each becomes that kind's loop when a
    kernel compiles.

    Why not the loops themselves in each kernel's closure: Numba keys a cached closure on its
    pickled cells, and a pickled dispatcher carries a random id drawn anew in every process, so
    no process ever found the decode and prefill kernels in the on-disk cache: ``warmup()``
    recompiled them every time (29-45 s, against 0.3 s with the cache; measured on the Intel VM).
    The kind is named, not read from the cache's dtype: float16 and bfloat16 pages are both
    uint16 inside the kernels.
    """
    def page_scores(kind, q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
        raise NotImplementedError("called by the compiled kernels only")

    def page_accumulate(kind, probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
        raise NotImplementedError("called by the compiled kernels only")

    @overload(page_scores, prefer_literal=True, inline="always")
    def _scores(kind, q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
        if not isinstance(kind, types.StringLiteral):
            return None
        loop = loops[kind.literal_value][0]

        def impl(kind, q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
            loop(q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again)
        return impl

    @overload(page_accumulate, prefer_literal=True, inline="always")
    def _values(kind, probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
        if not isinstance(kind, types.StringLiteral):
            return None
        loop = loops[kind.literal_value][1]

        def impl(kind, probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
            loop(probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again)
        return impl

    def chunk_accumulate(kind, probs, r0, num_rows, vc, blocks, aheads, num_blocks, last_tokens, acc):
        raise NotImplementedError("called by the compiled kernels only")

    @overload(chunk_accumulate, prefer_literal=True, inline="always")
    def _chunk_values(kind, probs, r0, num_rows, vc, blocks, aheads, num_blocks, last_tokens, acc):
        if not isinstance(kind, types.StringLiteral):
            return None
        loop = loops[kind.literal_value][2]

        def impl(kind, probs, r0, num_rows, vc, blocks, aheads, num_blocks, last_tokens, acc):
            loop(probs, r0, num_rows, vc, blocks, aheads, num_blocks, last_tokens, acc)
        return impl

    return page_scores, page_accumulate, chunk_accumulate


DECODE_SCORES, DECODE_VALUES, _ = _by_storage(_TILED)
PREFILL_SCORES, _, PREFILL_CHUNK_VALUES = _by_storage(_PREFILL_TILED)


@njit(inline="always", **JIT)
def takes_fma_tiles(k_cache):
    """Whether a storage's FMA tiles apply: head_dim a multiple of 16."""
    return k_cache.shape[3] % LANES == 0
