"""Paged prefill and decode attention over bfloat16 pages by Intel AMX tiles (kernels/_amx.py).

:func:`prefill` does the work of :func:`pagekv.kernels.attention.prefill` — work items of one KV
head of one sequence and a GQA group's heads together, causal and window masks, chunked online
softmax and prefetches — with the products by AMX tiles. An item holds several blocks of 16 query
tokens (:func:`item_tokens`); per chunk of keys it lays them out once for all its blocks:

- the keys in B's layout (pairs of dims; :func:`_amx.transpose_words`), 16 keys at a time;
- the value rows interleaved in pairs of tokens (:func:`_interleave_values`);

then each block, from its own causal and window range, takes the chunk: its query rows in groups
of 16 (the last group padded with zero rows), one tile product per 32 dims and row group gives 16
x 16 scores (:func:`_amx.score_tiles`); the softmax, straight to bfloat16 probabilities
(:func:`softmax_to_bf16`; with a soft cap or ALiBi, :func:`softmax_update` then
:func:`_pack_probs`), two tokens to a word, times the interleaved values, one tile product per 16
rows, 32 tokens and 16 dims, the sums of a row group and 64 dims staying in tiles across the chunk
(:func:`_amx.load_sums`, :func:`_amx.accumulate_pairs`, :func:`_amx.store_sums`).

:func:`decode` does the work of :func:`pagekv.kernels.attention.decode` (the same planned items:
a sequence's run of pages, all KV heads) with tiles shaped to the GQA group (see its docstring).

What is rounded is what the ``vdpbf16ps`` path rounds (the query and the probabilities, once each,
to bfloat16; products exact, sums float32), so results agree with it to the order of float32 sums.

Taken when the CPU has AMX-BF16 (:data:`pagekv.kernels._amx.AVAILABLE`), the cache is bfloat16,
``fast_bf16`` is on, head_dim is a multiple of 32 and the page size a multiple of 16
(:func:`applies`), and for decode where it measured faster (:func:`applies_to_decode`); otherwise
the ``vdpbf16ps`` kernels run.
"""

import numpy as np
from numba import njit, prange

from pagekv.kernels import _amx, _softmax_ir
from pagekv.kernels._dtypes import FORMAT_BFLOAT16
from pagekv.kernels._math import JIT, fast_exp
from pagekv.kernels._tile_rows import pack_pairs, to_bf16
from pagekv.kernels.attention import CHUNK_TOKENS, QUERY_BLOCK, _prefill_ahead
from pagekv.kernels.online_softmax import (finish_row, softmax_to_bf16, softmax_update,
                                           start_decode_item, start_prefill_item, thread_scratch)
from pagekv.kernels.prefetch import CACHE_LINE, block_address, prefetch_rows, prime_pages

ROWS, CHUNK, ROW_BYTES = _amx.ROWS, _amx.CHUNK, _amx.ROW_BYTES
PAIR_TOKENS = 2 * ROWS  # tokens per value tile product in prefill: 16 pairs


def applies(k_cache, kv_format, dot_products):
    """Whether :func:`prefill` serves this call (else the ``vdpbf16ps`` kernel does)."""
    page_size, head_dim = k_cache.shape[2], k_cache.shape[3]
    return bool(_amx.AVAILABLE and dot_products and kv_format == FORMAT_BFLOAT16
                and head_dim % CHUNK == 0 and page_size % ROWS == 0)


# Most query rows (tokens x GQA group) per prefill work item. An item lays each chunk's keys and
# values out for the tiles once for all its blocks of QUERY_BLOCK tokens, which items of one block
# redid for every block (at S1 the layouts took about half the time: time saved by leaving each
# out, though that also left the pages unread). Intel Xeon, 2026-12-04, fresh processes taking
# turns (each steady within itself since the arena, _arena), median ms per call, items of one
# block -> 512 rows: S1 110-161 -> 97-99, S3 73-82 -> 56-61, G3 86-122 -> 69-70, G7 84-121 ->
# 78-79. Against 512 rows: 256 S1 97-104, G7 78-80; 1,024 the same as 512. Without the arena,
# larger items had measured slower (S1 at 128 tokens 0.97-0.99x the time of one block, at 64
# 0.75-0.77x).
ITEM_ROWS = 512
ITEMS_PER_SLOT = 2  # smaller items where a call has fewer query rows, so every slot gets work


def item_tokens(num_tokens, group, num_kv_heads, num_slots):
    """Query tokens per work item of :func:`prefill` for a call of ``num_tokens`` query tokens: a
    multiple of QUERY_BLOCK up to ITEM_ROWS rows (tokens x group), leaving ITEMS_PER_SLOT items
    per slot where the call has that many blocks."""
    most = max(QUERY_BLOCK, ITEM_ROWS // group // QUERY_BLOCK * QUERY_BLOCK)
    fair = num_tokens * num_kv_heads // (ITEMS_PER_SLOT * num_slots)
    return max(QUERY_BLOCK, min(most, fair // QUERY_BLOCK * QUERY_BLOCK))


# Decode takes AMX for GQA groups of 2-16 query rows (16: one tile's rows) at head_dim up to 128,
# of 4-16 above it (256). Measured against the vdpbf16ps kernel on the Intel Xeon VM (time ratios,
# alternating rounds in one process; "memory" with the 300 MiB L3 evicted before each round, "L2"
# with every page mapped onto 1 MiB): group 4 / head_dim 128 (S1) 0.91 memory, 0.78 L2; 3 / 128:
# 0.97, 0.78; 7 / 128: 0.71, 0.49; 16 / 128: 0.49, 0.39; 4 / 64: 0.92, 0.75; 4 / 96: 1.02, 0.82 —
# before the stacked value tiles (kernels/_amx.py), which took groups 3-8 to 0.77-0.81x that time
# from L2, 0.91-0.97x from memory. With them: group 2 / 128 0.94 memory (twice), 0.70 L2; head_dim
# 256: group 4 (16 x 2,048 tokens, 32 / 8 heads) 0.86-0.91 memory, 0.54-0.55 L2; 8 (1 x 32,768,
# 16 / 2, as Qwen3-Next's attention layers) 0.63, 0.42; 16 (16 x 2,048, 32 / 2) 0.45, 0.31. Not
# taken: MHA (group 1) / 128 1.00, 1.09; / 64 (S3) 0.97-1.01, 0.75; head_dim 256 with group 2
# (Gemma's) 1.04, group 3 1.02. The score tiles cost the same for any group (16 keys per row), so
# the smallest groups favour vdpbf16ps, the more so the wider the head.
DECODE_GROUPS = (2, ROWS)
WIDE_HEAD_DIM = 128  # above it, decode takes AMX from a group of WIDE_MIN_GROUP
WIDE_MIN_GROUP = 4


def applies_to_decode(k_cache, kv_format, dot_products, group):
    """Whether :func:`decode` serves this call (else the ``vdpbf16ps`` kernel does): as
    :func:`applies`, for GQA groups and head_dims where AMX decode measured faster."""
    smallest = DECODE_GROUPS[0] if k_cache.shape[3] <= WIDE_HEAD_DIM else WIDE_MIN_GROUP
    return bool(applies(k_cache, kv_format, dot_products) and smallest <= group <= DECODE_GROUPS[1])


@njit(**JIT)
def _scale(scores, num_rows, num_cols, scale):
    """scores[:num_rows, :num_cols] *= scale: the tiles multiply unscaled bfloat16 queries, so a
    bfloat16 query stays exact (as in the ``vdpbf16ps`` tiles, which scale their sums)."""
    for r in range(num_rows):
        for t in range(num_cols):
            scores[r, t] *= scale


@njit(inline="always", **JIT)
def _pair_rows(tokens):
    """Rows of token pairs that prefill's value tiles read for ``tokens`` tokens: whole products of
    16 pairs (:data:`PAIR_TOKENS` tokens); the callers zero the pairs past the tokens."""
    return -(-tokens // PAIR_TOKENS) * ROWS


@njit(**JIT)
def _pack_probs(scores, num_rows, num_cols, packed):
    """Prefill's probabilities as the A tiles of :func:`_amx.accumulate_pairs`: bfloat16 two tokens
    to a word (:func:`pack_pairs`), 0 for the columns past num_cols up to the next multiple of
    32.

    scores : float32 [rows, cols]; packed : uint32 [rows, pairs], pairs a multiple of 16.
    """
    pack_pairs(scores, 0, num_rows, num_cols, packed)
    padded = min(_pair_rows(num_cols), packed.shape[1])
    for r in range(num_rows):
        for j in range((num_cols + 1) // 2, padded):
            packed[r, j] = 0


@njit(**JIT)
def _interleave_values(v_cache, block_table, seq, head, first, last, seq_len, v_pairs):
    """The value rows of pages first .. last - 1 of a sequence's head in B's layout of
    :func:`_amx.accumulate_pairs`: v_pairs[k, d] holds dim d of the chunk's tokens 2k (low 16
    bits) and 2k + 1 (high); 0 for the tokens past seq_len up to the next multiple of 32 (the rows
    there may hold anything, NaN included, and 0 x NaN would spoil the sums).

    v_pairs : uint32 [pairs, head_dim], pairs >= 16 * ceil(tokens / 32).
    """
    page_size, head_dim = v_cache.shape[2], v_cache.shape[3]
    num_cols = min((last - first) * page_size, seq_len - first * page_size)
    for p in range(first, last):
        page = block_table[seq, p]
        for t in range(0, min(page_size, seq_len - p * page_size), 2):
            k = ((p - first) * page_size + t) // 2
            if (p - first) * page_size + t + 1 < num_cols:
                for d in range(head_dim):
                    v_pairs[k, d] = (np.uint32(v_cache[page, head, t, d])
                                     | (np.uint32(v_cache[page, head, t + 1, d]) << np.uint32(16)))
            else:  # the sequence's last token, in the low half
                for d in range(head_dim):
                    v_pairs[k, d] = np.uint32(v_cache[page, head, t, d])
    for k in range((num_cols + 1) // 2, min(_pair_rows(num_cols), v_pairs.shape[0])):
        for d in range(head_dim):
            v_pairs[k, d] = 0


@njit(**JIT)
def _spread_pairs(scores, num_rows, group, num_cols, spread):
    """Decode's probabilities as the A tiles of :func:`_amx.accumulate_stacked`: per KV head and set
    of query rows of its group (:func:`_amx.value_sets`), two rows per query row, bfloat16 in the low half of
    each word, then in the high half (the other half 0); 0 for the columns past num_cols up to the
    next multiple of 16, and rows past the group stay 0.

    scores : float32 [rows, cols], its first num_rows (num_q_heads) read; spread : uint32
    [num_kv_heads * num_sets * 2 * set_rows, cols], zeroed when allocated.
    """
    num_sets, set_rows = _amx.value_sets(group), _amx.value_set_rows(group)
    padded = min(-(-num_cols // ROWS) * ROWS, scores.shape[1])
    for q in range(num_rows):
        head, g = q // group, q % group
        r = 2 * ((head * num_sets + g // set_rows) * set_rows + g % set_rows)
        for t in range(num_cols):
            bits = np.uint32(to_bf16(scores[q, t]))
            spread[r, t] = bits
            spread[r + 1, t] = bits << np.uint32(16)
        for t in range(num_cols, padded):
            spread[r, t] = 0
            spread[r + 1, t] = 0


@njit(**JIT)
def _columns_softmax(scores_by_key, num_rows, begin, num_cols, scale, m, l, chunk_sums, spread):
    """Decode's plain softmax over one chunk, from the score tiles' layout straight into the value
    tiles' A rows: :func:`_spread_pairs` of what :func:`softmax_update` would give for unscaled
    scores with no soft cap and no ALiBi, the keys before ``begin`` (a sliding window's) masked,
    each probability rounded as :func:`pagekv.kernels.online_softmax.softmax_to_bf16` rounds it.

    Down the columns, 16 query rows to a vector (kernels/_softmax_ir.py): the largest scaled
    score, then 16 keys at a time their exps, turned 16 x 16 in registers into the query rows'
    A rows, where the scores took a transpose, a scaling pass, a softmax per row and a spread.

    scores_by_key : float32 [cols, rows], scores_by_key[t, q] = key key0 + t times query row q,
    not yet multiplied by ``scale``; its columns past num_rows finite (0). m, l : float32 [rows],
    the running max and sum (folded here; the rows past num_rows finite); chunk_sums : float32
    [rows], scratch; spread : uint32 [2 * rows, cols], as :func:`_spread_pairs` fills it when
    query row q's rows are 2q and 2q + 1.
    """
    rows, step = scores_by_key.shape[1], scores_by_key.strides[0]
    padded = min(-(-num_cols // ROWS) * ROWS, scores_by_key.shape[0])
    if begin < num_cols:
        for r0 in range(0, rows, ROWS):
            _softmax_ir.strip_max(scores_by_key.ctypes.data + r0 * 4, step, begin, num_cols, scale,
                                  chunk_sums.ctypes.data + r0 * 4)
        for q in range(num_rows):
            top = max(m[q], chunk_sums[q])
            l[q] *= fast_exp(m[q] - top)  # 0 on the first chunk (m = -inf)
            m[q] = top
    chunk_sums[:] = 0.0
    p_step = spread.strides[0]
    for r0 in range(0, rows, ROWS):
        for t0 in range(0, padded, ROWS):
            _softmax_ir.exp_to_pairs(scores_by_key.ctypes.data + r0 * 4, step, t0, begin, num_cols,
                                     scale, m.ctypes.data + r0 * 4, chunk_sums.ctypes.data + r0 * 4,
                                     spread.ctypes.data + 2 * r0 * p_step, p_step)
    for q in range(num_rows):
        l[q] += chunk_sums[q]


@njit(**JIT)
def _rescale_sums(m_before, m, group, sums):
    """Rescale the value sums of each query row whose running max rose from m_before to m, as
    :func:`pagekv.kernels.online_softmax.softmax_update` would rescale its acc row (the same factor).

    m_before, m : float32 [num_q_heads]; sums : as in :func:`decode` (float32 [num_kv_heads,
    chunks * num_sets, set_rows, 32]).
    """
    num_sets, set_rows = _amx.value_sets(group), _amx.value_set_rows(group)
    for q in range(m_before.shape[0]):
        if m[q] != m_before[q]:
            alpha = fast_exp(m_before[q] - m[q])  # 0 from the first chunk's -inf
            head, g = q // group, q % group
            for tile in range(g // set_rows, sums.shape[1], num_sets):
                for j in range(CHUNK):
                    sums[head, tile, g % set_rows, j] *= alpha


@njit(**JIT)
def _sums_to_acc(sums, group, acc):
    """acc[q] = the value sums of query row q from the tiles' layout (as :func:`finish_row` reads
    them: a chunk's 16 even then 16 odd dims, :func:`_amx.acc_dim`).

    sums : float32 [num_kv_heads, chunks * num_sets, set_rows, 32], tile c * num_sets + s of a KV
    head holding chunk c of its query rows' set s (:func:`_amx.accumulate_stacked`); acc : float32
    [rows, head_dim], its first num_q_heads rows written.
    """
    num_sets, set_rows = _amx.value_sets(group), _amx.value_set_rows(group)
    for q in range(sums.shape[0] * group):
        head, g = q // group, q % group
        for c in range(sums.shape[1] // num_sets):
            for j in range(CHUNK):
                acc[q, c * CHUNK + j] = sums[head, c * num_sets + g // set_rows, g % set_rows, j]


@njit(**JIT)
def _zero_padded(v_cache, page, head, t0, n, tail):
    """tail[:n] = value rows t0 .. t0 + n - 1 of block (page, head), tail[n:] = 0: a page's rows
    past seq_len may hold anything, NaN included, and 0 x NaN would spoil the sums."""
    for i in range(ROWS):
        for d in range(tail.shape[1]):
            tail[i, d] = v_cache[page, head, t0 + i, d] if i < n else 0


@njit(inline="always", **JIT)
def _rows_at(block, offset):
    """The address ``offset`` bytes into the block at address ``block``; 0 (none) if it is 0."""
    return block + offset if block != 0 else 0


@njit(inline="always", **JIT)
def _tile_rows(values, row_bytes, num_tokens, t0, tail, tail_step):
    """Address and row step of the 16 value rows from token t0 of a page's block at address
    ``values`` (num_tokens of its rows valid): the block's own, or where fewer than 16 are left,
    the zero-padded copy at address ``tail`` (:func:`_zero_padded`)."""
    if num_tokens - t0 < ROWS:
        return np.int64(tail), tail_step
    return values + t0 * row_bytes, row_bytes


PAGE_BYTES = 4096


@njit(**JIT)
def _arena(shapes):
    """One allocation for a thread's tile operands, each a [rows, words] array of 32-bit words
    (shapes: int64 [n, 2]) starting on a 4 KiB page: returns the arena (uint32) and where each
    array starts in it (int64 [n], in words).

    Allocated one by one, the arrays landed anywhere in their pages, differently in every
    process, and one process's S1 prefill took up to 1.4x another's (AMX, Intel Xeon: 93-137 ms
    over six processes, steady within each, whatever the caches' own addresses; in the arena
    87-98 ms over fourteen; rows padded by a line on top: no different).
    """
    words = PAGE_BYTES // 4
    starts = np.empty(shapes.shape[0], np.int64)
    end = 0
    for i in range(shapes.shape[0]):
        starts[i] = end
        end += -(-shapes[i, 0] * shapes[i, 1] // words) * words
    arena = np.empty(end + words, np.uint32)
    first = (-arena.ctypes.data % PAGE_BYTES) // 4
    return arena, starts + first


@njit(inline="always", **JIT)
def _words(arena, start, shape):
    """The arena's array from word ``start``: uint32 [shape[0], shape[1]]."""
    return arena[start:start + shape[0] * shape[1]].reshape((shape[0], shape[1]))


@njit(parallel=True, **JIT)
def prefill(q, k_cache, v_cache, block_table, seq_lens, qo_indptr, items, slot_indptr, scale, window,
            soft_cap, alibi_slopes, out, lse, prefetch_blocks):
    """:func:`pagekv.kernels.attention.prefill` for bfloat16 pages by AMX tiles (same arguments,
    without kv_format and dot_products); see :func:`applies` for the shapes it takes.

    An item (:func:`item_tokens` query tokens) lays each chunk of keys and values out for the
    tiles once, then runs its rows block by block (:data:`QUERY_BLOCK` tokens, the GQA group's
    heads together) over them, each block from its own causal and window range.
    """
    num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    chunks = head_dim // CHUNK
    most_tokens = 0
    for item in range(items.shape[0]):
        most_tokens = max(most_tokens, items[item, 3] - items[item, 2])
    padded_rows = -(-most_tokens * group // ROWS) * ROWS
    block_rows = QUERY_BLOCK * group  # a multiple of ROWS: blocks start on a tile's first row
    chunk_pages = max(1, CHUNK_TOKENS // page_size)
    cols = chunk_pages * page_size
    row_bytes = k_cache.strides[2]
    # The plain softmax in two vector passes per row (kernels/_softmax_ir.py), where scaling, the
    # softmax and packing took four: S1 prefill 0.79x the time, S3 0.83x, G7 0.78x (Intel Xeon,
    # fresh processes taking turns, 2026-12-04)
    plain = soft_cap <= 0.0 and alibi_slopes.shape[0] == 0
    for slot in prange(slot_indptr.shape[0] - 1):
        # The item's rows; scores and probabilities one block's (blocks take turns per chunk: at
        # the item's size they took S1 1.19x the time). The tiles' operands lie in one arena, acc
        # among them; no float32 queries (qs, empty): the tiles take q_bits.
        qs, _, m, l, qpos, _ = thread_scratch(padded_rows, 0, 0)
        pairs = _pair_rows(cols)
        shapes = np.array([(block_rows, cols), (padded_rows, head_dim // 2), (block_rows, pairs),
                           (pairs, head_dim), (cols * chunks, ROWS), (padded_rows, head_dim)])
        arena, starts = _arena(shapes)
        scores = _words(arena, starts[0], shapes[0]).view(np.float32)
        q_bits = _words(arena, starts[1], shapes[1]).view(np.uint16)  # bfloat16 rows, pairs to a word
        packed = _words(arena, starts[2], shapes[2])
        probs = packed.view(np.uint16)  # the same, a bfloat16 per key
        v_pairs = _words(arena, starts[3], shapes[3])
        keys_t = _words(arena, starts[4], shapes[4])  # a chunk's keys, 16 at a time (B's layout)
        acc = _words(arena, starts[5], shapes[5]).view(np.float32)
        q_bits[:] = 0
        packed[:] = 0
        slopes = np.empty(padded_rows if alibi_slopes.shape[0] > 0 else 0, np.float32)
        q_step, s_step = q_bits.strides[0], scores.strides[0]
        p_step, a_step, v_step = packed.strides[0], acc.strides[0], v_pairs.strides[0]
        config = _amx.tile_config()
        _amx.configure(config.ctypes.data)
        for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
            seq, head, row_begin, row_end = items[item]
            seq_len = seq_lens[seq]
            num_rows, low, high, page_begin, page_end = start_prefill_item(
                q, qo_indptr, seq, seq_len, head, row_begin, row_end, group, page_size, window, scale,
                True, alibi_slopes, qs, q_bits, acc, m, l, qpos, slopes)
            padded = -(-num_rows // ROWS) * ROWS
            q_bits[num_rows:padded] = 0  # a last group's padding: zero queries, zero probabilities
            for first in range(page_begin, page_end, chunk_pages):
                last = min(first + chunk_pages, page_end)
                key0 = first * page_size
                num_cols = min((last - first) * page_size, seq_len - key0)
                for p in range(first, last):
                    prefetch_rows(_prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                 page_end, chunk_pages, False, prefetch_blocks),
                                  row_bytes, 0, page_size)
                    num_tokens = min(page_size, seq_len - p * page_size)
                    for t0 in range(0, num_tokens, ROWS):
                        keys = block_address(k_cache, block_table[seq, p], head) + t0 * row_bytes
                        col = (p - first) * page_size + t0
                        slab = keys_t.ctypes.data + col // ROWS * chunks * _amx.TILE_BYTES
                        for c in range(chunks):  # the keys in B's layout, 32 dims at a time
                            _amx.transpose_words(keys + c * ROW_BYTES, row_bytes,
                                                 slab + c * _amx.TILE_BYTES, ROW_BYTES)
                for p in range(first, last):
                    prefetch_rows(_prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                 page_end, chunk_pages, True, prefetch_blocks),
                                  row_bytes, 0, page_size)
                _interleave_values(v_cache, block_table, seq, head, first, last, seq_len, v_pairs)
                for r0 in range(0, num_rows, block_rows):
                    rows = min(block_rows, num_rows - r0)
                    block_low, block_high = qpos[r0], qpos[r0 + rows - 1]
                    # The block's keys in this chunk: none past its last query (causal), none if
                    # the whole chunk lies before its window; the skipped would all be masked.
                    block_cols = min(num_cols, block_high + 1 - key0)
                    if block_cols <= 0 or (window > 0 and key0 + num_cols - 1 <= block_low - window):
                        continue
                    groups = -(-rows // ROWS)
                    packed[rows:groups * ROWS] = 0
                    for key in range(0, block_cols, ROWS):
                        for g0 in range(0, groups, _amx.GROUPS):
                            _amx.score_tiles(q_bits.ctypes.data + (r0 + g0 * ROWS) * q_step, q_step,
                                             keys_t.ctypes.data + key * chunks * ROW_BYTES,
                                             min(_amx.GROUPS, groups - g0), chunks,
                                             scores.ctypes.data + g0 * ROWS * s_step + key * 4, s_step, 0, 0)
                    if plain:
                        softmax_to_bf16(scores, rows, block_cols, key0, qpos[r0:], window, scale, m[r0:],
                                        l[r0:], acc[r0:], probs)
                    else:
                        _scale(scores, rows, block_cols, scale)
                        masked = (key0 + block_cols - 1 > block_low
                                  or (window > 0 and key0 <= block_high - window))
                        softmax_update(scores, 0, rows, block_cols, key0, qpos[r0:], masked, window, soft_cap,
                                       slopes[r0:], m[r0:], l[r0:], acc[r0:])
                        _pack_probs(scores, rows, block_cols, packed)
                    for d0 in range(0, head_dim // ROWS, _amx.SUM_TILES):  # 16 dims per sum tile
                        n = min(_amx.SUM_TILES, head_dim // ROWS - d0)
                        for g in range(groups):
                            sums = acc.ctypes.data + (r0 + g * ROWS) * a_step + d0 * ROW_BYTES
                            _amx.load_sums(sums, ROW_BYTES, a_step, n)
                            for t0 in range(0, block_cols, PAIR_TOKENS):
                                _amx.accumulate_pairs(packed.ctypes.data + g * ROWS * p_step + t0 * 2,
                                                      p_step, v_pairs.ctypes.data + t0 // 2 * v_step
                                                      + d0 * ROW_BYTES, v_step, n)
                            _amx.store_sums(sums, ROW_BYTES, a_step, n)
            for i in range(row_end - row_begin):
                for g in range(group):
                    r = i * group + g
                    lse[row_begin + i, head * group + g] = finish_row(
                        acc[r], m[r], l[r], out[row_begin + i, head * group + g], False)
        _amx.release()


@njit(**JIT)
def _queries_by_pairs(q_bits, group, q_t):
    """The queries in the B layout of decode's score tiles: q_t[h, c, k, g] holds dims 32c + 2k
    and 32c + 2k + 1 (low, high 16 bits) of query row h * group + g.

    q_bits : uint16 [num_q_heads, head_dim]; q_t : uint32 [num_kv_heads, head_dim // 32, 16, 16]
    (words g >= group unused).
    """
    for h in range(q_t.shape[0]):
        for c in range(q_t.shape[1]):
            for k in range(ROWS):
                d = c * CHUNK + 2 * k
                for g in range(group):
                    low, high = q_bits[h * group + g, d], q_bits[h * group + g, d + 1]
                    q_t[h, c, k, g] = np.uint32(low) | (np.uint32(high) << np.uint32(16))


@njit(**JIT)
def _visits(k_cache, v_cache, block_table, seq, first, last, page_end, chunk_pages, out):
    """The addresses of the blocks :func:`decode` reads from the start of the chunk of pages first
    .. last - 1, in its order: the chunk's K blocks head by head (each head's pages in turn), its V
    blocks alike, then the next chunk's K blocks. Returns how many (out: int64, at least
    3 * chunk_pages * num_kv_heads).

    The block to prefetch ``distance`` visits ahead is then one load away, out[i + distance]
    (:func:`_ahead`), where computing it from the visit number takes divisions by the chunk's
    page count for every block (as :func:`pagekv.kernels.attention._block_ahead` does for the
    page-major kernels). Against that: 0.95-0.99x the time from L2 and L3, the same from memory
    (S1, S2, G7; alternating rounds).
    """
    n = 0
    next_last = min(last + chunk_pages, page_end)
    for cache, begin, end in ((k_cache, first, last), (v_cache, first, last), (k_cache, last, next_last)):
        for head in range(k_cache.shape[1]):
            for p in range(begin, end):
                out[n] = block_address(cache, block_table[seq, p], head)
                n += 1
    return n


@njit(inline="always", **JIT)
def _ahead(visits, num_visits, i, distances):
    """The addresses to prefetch at visit i, distances[0] and distances[1] visits ahead, and to
    prime (:func:`pagekv.kernels.prefetch.prime_pages`) distances[2] ahead (0: none)."""
    far, near, primed = i + distances[0], i + distances[1], i + distances[2]
    return (visits[far] if distances[0] > 0 and far < num_visits else 0,
            visits[near] if distances[1] > 0 and near < num_visits else 0,
            visits[primed] if distances[2] > 0 and primed < num_visits else 0)


@njit(parallel=True, **JIT)
def decode(q, k_cache, v_cache, block_table, seq_lens, items, slot_indptr, scale, window, soft_cap,
           alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks):
    """:func:`pagekv.kernels.attention.decode` for bfloat16 pages by AMX tiles (same arguments,
    without kv_format and dot_products); see :func:`applies_to_decode` for the shapes it takes.

    Per chunk of pages, head by head (the value sums of a head stay in tiles across the chunk's
    pages, so the blocks are visited head-major, and prefetched in that order: :func:`_visits`):
    scores as S^T = K Q^T, a page's key rows as they lie times the group's queries in pairs of
    dims (:func:`_queries_by_pairs`), then the softmax over every head's rows (down the scores'
    columns, :func:`_columns_softmax`, or with a soft cap or ALiBi row by row), then the values:
    the probabilities of up to 8 query rows stacked in one A tile, in even bfloat16 slots and
    again in odd ones (:func:`_spread_pairs`), so that one tile product per 16 tokens and 32 dims
    sums both halves of the dims (:func:`_amx.accumulate_stacked`), 128 dims per pass over the
    chunk's pages (64 for a group of two sets).
    """
    num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    chunks = head_dim // CHUNK
    chunk_pages = max(1, CHUNK_TOKENS // page_size)
    cols = chunk_pages * page_size
    padded_rows = -(-num_q_heads // ROWS) * ROWS
    row_bytes = k_cache.strides[2]
    num_sets, set_rows = _amx.value_sets(group), _amx.value_set_rows(group)
    pass_chunks = _amx.SUM_TILES // num_sets  # 32-dim chunks per pass over a head's value blocks
    # Where a head's value blocks are read in more than one pass (head_dim over 128, or 64 for a
    # group of more than 8), each pass prefetches its share of the rows ahead, so the requests go
    # out at an even pace: from memory, S1 0.95-0.97x, S2 0.93-0.94x, G3 0.93x the time of the
    # first pass asking for all of them (measured with two passes per head). Rounded up to four
    # lines (accumulate_stacked prefetches it in up to four parts).
    quad = 4 * CACHE_LINE
    share = -(-ROWS * row_bytes // (-(-chunks // pass_chunks) * quad)) * quad
    configs = _amx.decode_configs(group)
    # Every visit jumps (head by head, a head's blocks are a page apart on any layout), so each
    # block's 4 KiB pages are primed half again as far ahead as its lines are requested. Intel
    # Xeon, processes taking turns (11-21 rounds), random pages, new / old time: S1 0.974, S2
    # 0.970, G7 0.979, G8 0.984; consecutive pages 0.99-1.02. S1 at 2x 0.98, 3x-4x 0.99-1.01 (6 rounds).
    distances = (prefetch_blocks[0], prefetch_blocks[1], prefetch_blocks[0] + prefetch_blocks[0] // 2)
    block_bytes = k_cache.strides[1]
    # The plain softmax (no soft cap, no ALiBi) runs down the score tiles' columns
    # (:func:`_columns_softmax`) where query row q's probabilities go to A rows 2q and 2q + 1: every
    # group but the odd ones over 8. Intel Xeon, against the transposes, softmax_update and
    # _spread_pairs (processes alternating, new / old time): from cache S1 0.86, S2 0.85, G7 0.80,
    # G8 0.91; from memory 0.94-0.99 (S1, S2, G3, G7, G8; 101 rounds).
    columns = soft_cap <= 0.0 and alibi_slopes.shape[0] == 0 and num_sets * set_rows == group
    for slot in prange(slot_indptr.shape[0] - 1):
        qs, acc, m, l, qpos, scores = thread_scratch(padded_rows, cols, head_dim)
        # the score tiles' layout; its columns past the query rows stay 0 (finite, for the
        # vectors of 16 rows of _columns_softmax)
        scores_by_key = np.zeros((cols, padded_rows), np.float32)
        m[num_q_heads:] = 0.0
        chunk_sums = np.empty(padded_rows, np.float32)
        q_bits = np.empty((num_q_heads, head_dim), np.uint16)
        q_t = np.zeros((num_kv_heads, chunks, ROWS, ROWS), np.uint32)
        spread = np.zeros((max(num_kv_heads * num_sets * 2 * set_rows, 2 * padded_rows), cols), np.uint32)
        # The value sums in the tiles' layout for the whole item (acc gets them at its end): tile
        # c * num_sets + s of a head holds chunk c of its set s (:func:`_sums_to_acc`).
        sums = np.empty((num_kv_heads, chunks * num_sets, set_rows, CHUNK), np.float32)
        m_before = np.empty(num_q_heads, np.float32)
        no_acc = acc[:, :0]  # softmax_update rescales no acc here: _rescale_sums does, on sums
        tails = np.zeros((num_kv_heads, ROWS, head_dim), np.uint16)
        visits = np.empty(3 * chunk_pages * num_kv_heads, np.int64)
        p_step = spread.strides[0]
        s_step, k_step = scores.strides[0], scores_by_key.strides[0]
        for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
            seq, page_begin, page_end, part = items[item]
            seq_len = seq_lens[seq]
            start_decode_item(q, seq, seq_len, scale, True, qs, q_bits, acc, m, l, qpos)
            _queries_by_pairs(q_bits, group, q_t)
            sums[:] = 0
            for first in range(page_begin, page_end, chunk_pages):
                last = min(first + chunk_pages, page_end)
                key0 = first * page_size
                num_cols = min((last - first) * page_size, seq_len - key0)
                num_visits = _visits(k_cache, v_cache, block_table, seq, first, last, page_end,
                                     chunk_pages, visits)
                span = (last - first) * num_kv_heads  # the K pass's visits
                _amx.configure(configs.ctypes.data)
                for head in range(num_kv_heads):
                    queries = q_t.ctypes.data + head * q_t.strides[0]
                    for p in range(first, last):
                        ahead, again, primed = _ahead(visits, num_visits, head * (last - first) + p - first,
                                                      distances)
                        prime_pages(primed, block_bytes)
                        keys = block_address(k_cache, block_table[seq, p], head)
                        for t0 in range(0, min(page_size, seq_len - p * page_size), ROWS):
                            col = (p - first) * page_size + t0
                            _amx.score_tiles(keys + t0 * row_bytes, row_bytes, queries, 1, chunks,
                                             scores_by_key.ctypes.data + col * k_step + head * group * 4,
                                             k_step, _rows_at(ahead, t0 * row_bytes),
                                             _rows_at(again, t0 * row_bytes))
                m_before[:] = m[:num_q_heads]
                if columns:
                    begin = max(0, seq_len - window - key0) if window > 0 else 0
                    _columns_softmax(scores_by_key, num_q_heads, begin, num_cols, scale, m, l,
                                     chunk_sums, spread)
                else:
                    for t0 in range(0, num_cols, ROWS):  # one query row per row, 16 x 16 at a time
                        for r0 in range(0, padded_rows, ROWS):
                            _amx.transpose_words(scores_by_key.ctypes.data + t0 * k_step + r0 * 4,
                                                 k_step, scores.ctypes.data + r0 * s_step + t0 * 4,
                                                 s_step)
                    _scale(scores, num_q_heads, num_cols, scale)
                    masked = window > 0 and key0 <= seq_len - 1 - window
                    softmax_update(scores, 0, num_q_heads, num_cols, key0, qpos, masked, window,
                                   soft_cap, alibi_slopes, m, l, no_acc)
                    _spread_pairs(scores, num_q_heads, group, num_cols, spread)
                _rescale_sums(m_before, m, group, sums)
                last_tokens = min(page_size, seq_len - (last - 1) * page_size)
                if last_tokens % ROWS:  # the sequence's last page ends inside a tile
                    for head in range(num_kv_heads):
                        _zero_padded(v_cache, block_table[seq, last - 1], head,
                                     last_tokens - last_tokens % ROWS, last_tokens % ROWS, tails[head])
                _amx.configure(configs.ctypes.data + _amx.CONFIG_BYTES)
                for head in range(num_kv_heads):
                    probs = spread.ctypes.data + head * num_sets * 2 * set_rows * p_step
                    for c0 in range(0, chunks, pass_chunks):
                        n = min(pass_chunks, chunks - c0)
                        ahead_at = c0 // pass_chunks * share
                        tiles = sums.ctypes.data + head * sums.strides[0] + c0 * num_sets * sums.strides[1]
                        _amx.load_sums(tiles, sums.strides[1], ROW_BYTES, n * num_sets)
                        for p in range(first, last):
                            ahead, again, primed = _ahead(visits, num_visits,
                                                          span + head * (last - first) + p - first, distances)
                            if c0 == 0:  # a block read in several passes is primed once
                                prime_pages(primed, block_bytes)
                            values = block_address(v_cache, block_table[seq, p], head)
                            num_tokens = min(page_size, seq_len - p * page_size)
                            for t0 in range(0, num_tokens, ROWS):
                                rows, step = _tile_rows(values, row_bytes, num_tokens, t0,
                                                        tails.ctypes.data + head * tails.strides[0],
                                                        tails.strides[1])
                                _amx.accumulate_stacked(
                                    probs + ((p - first) * page_size + t0) * 4, 2 * set_rows * p_step, p_step,
                                    num_sets, rows + c0 * ROW_BYTES, step, n,
                                    _rows_at(ahead, t0 * row_bytes + ahead_at),
                                    _rows_at(again, t0 * row_bytes + ahead_at), share)
                        _amx.store_sums(tiles, sums.strides[1], ROW_BYTES, n * num_sets)
            _sums_to_acc(sums, group, acc)
            for h in range(num_q_heads):
                if part < 0:
                    lse[seq, h] = finish_row(acc[h], m[h], l[h], out[seq, h], True, True)
                else:
                    part_lse[part, h] = finish_row(acc[h], m[h], l[h], part_out[part, h], True, True)
        _amx.release()
