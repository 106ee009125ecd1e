"""Paged attention kernels: decode (one query token per sequence) and prefill (ragged, causal).

Layout (docs/layout.md): ``k_cache``, ``v_cache`` are ``[num_pages, num_kv_heads, page_size,
head_dim]``; one page of one head is a contiguous ``[page_size, head_dim]`` block. The kernels walk
``block_table [num_seqs, max_pages]`` (int32 physical page ids) and trust their input: the wrappers
in ``pagekv.attention`` validate it.

How the work is shaped:

- A decode *work item* is one sequence over a run of its pages, all KV heads together (a page's heads
  are adjacent in memory); a prefill item is one KV head of one sequence for a block of query
  tokens. The ``G`` query heads of a GQA group are processed together, so each K/V page is read
  from memory once per group.
- Online softmax is folded once per chunk of pages (at least CHUNK_TOKENS keys, whole pages): the
  chunk's scores are computed first, then the running max, sum and accumulator are rescaled once
  (the design note rescaled on every new maximum token): kernels/online_softmax.py.
- Work items are assigned to ``num_slots`` slots of equal cost by a planner that balances pages,
  cutting long sequences into pieces (flash-decoding); pieces are merged by log-sum-exp. The
  threads claim the slots one by one as they come free (kernels/slots.py: a few per thread), so
  no thread waits for another's long sequence, nor for a thread the machine runs slower.
- While a block (one page of one KV head) is read, the block a fixed distance ahead in the item's
  visit order is prefetched into L2, a few lines per token row (kernels/prefetch.py says why: it
  took S1 decode from ~50% to ~80% of the streaming-read bandwidth); decode's tiles ask again for
  a nearer block, as the CPU drops some prefetches (S1/S2 bfloat16 then read ~85%).
- bfloat16 and float8 pages (head_dim a multiple of 16, even page size) multiply in bfloat16
  with ``vdpbf16ps`` tiles (kernels/_tile_ir.py; float8 rows turned into bfloat16 by table
  lookups as they are loaded) where the CPU has them and ``fast_bf16`` allows:
  the queries and the probabilities are rounded to bfloat16 once, the sums stay float32. In
  float32 math the bfloat16 loops were bound by the CPU's multiply-adds below the memory roof;
  the tiles made S1 decode ~1.6x faster from cache. Prefill over float32 pages (head_dim a
  multiple of 16) computes scores and values by float32 FMA tiles of the same shapes: 1.4-1.7x
  faster there than Numba's loops; decode too (see :func:`decode`). Prefill items of 32 query
  rows or more score 16 keys at a time with the keys along the lanes (kernels/_key_lanes.py),
  and take a chunk's value blocks in one tile per 8 rows (vdpbf16ps). float16 pages, and
  bfloat16 and float8 pages not taking ``vdpbf16ps``, take the same FMA tiles, each row widened
  as it is loaded
  (kernels/page_loops.py: the loops over one page, and :func:`kernel_kind`, which picks). Numba's
  plain loops serve head_dim not a multiple of 16. On CPUs with AMX-BF16, bfloat16 prefill and
  decode with GQA groups of 2-16 take AMX tiles instead (kernels/amx_attention.py;
  ``pagekv.attention`` picks the kernel).
- Per-thread scratch is allocated once per thread per call, never inside the page loop.
"""

import math

import numpy as np
from numba import get_num_threads, njit, prange

from pagekv.kernels import _warm, slots
from pagekv.kernels._math import JIT
from pagekv.kernels._float8_rows import widen_into
from pagekv.kernels._tile_ir import PAIR_BYTES, PAIR_ORDER, PAIRED, PAIRED_FLOAT8
from pagekv.kernels._tile_rows import pack_pairs
from pagekv.kernels.online_softmax import (dot_scratch, finish_row, softmax_to_bf16, softmax_update,
                                           start_decode_item, start_prefill_item, thread_scratch)
from pagekv.kernels.page_loops import (DECODE_SCORES, DECODE_VALUES, KEY_LANE_ROWS, KINDS,
                                       PREFILL_CHUNK_VALUES, PREFILL_SCORES, kernel_kind,
                                       plain_page_accumulate, plain_page_scores, takes_fma_tiles)
from pagekv.kernels.prefetch import block_address

# Prefill query tokens per work item: the least of query_tokens; the AMX kernel's tokens per block.
QUERY_BLOCK = 16
# Keys per online-softmax update: pages are folded in chunks of this many tokens (whole pages), so
# small pages do not pay the per-update costs (max, rescale of the accumulators) every 16 tokens.
# Measured on S1 (float32, page 16): 15.5 GB/s folding per page, 17.9 per 64 tokens, 19.1 per 128,
# 19.5 per 256 (S3: 26.1 -> 35.2); page 128 folded per page had reached 23.7.
CHUNK_TOKENS = 256
# Prefill items over float8 pages with this many query rows turn a chunk's value blocks into
# bfloat16 once (kernels/_float8_rows.py) rather than in each of their 8-row chunk tiles. AMD Zen 4,
# processes alternating, new ÷ old time: S1 (64 rows) 0.88-0.92, G8 (128 rows) 0.88, S3 (32 rows,
# widened as well) 1.02, so smaller items keep the tiles' own conversion.
WIDEN_ROWS = 64


@njit(inline="always", **JIT)
def query_tokens(group):
    """Query tokens per prefill work item of :func:`prefill` for a GQA group of ``group`` query
    heads: QUERY_BLOCK, or more where that would give an item fewer than KEY_LANE_ROWS rows (MHA:
    32 tokens), so that it takes the key-lane score tiles and the chunk value tiles
    (kernels/page_loops.py)."""
    return max(QUERY_BLOCK, -(-KEY_LANE_ROWS // group))


@njit(inline="always", **JIT)
def _block_ahead(block_table, seq, p, h, num_heads, first, last, page_end, chunk_pages, v_pass,
                 distance):
    """The block ``distance`` visits after block (page p, head h), to prefetch while reading it.

    An item visits a chunk's K blocks (pages first .. last - 1, heads 0 .. num_heads - 1 of each),
    then the chunk's V blocks, then the next chunk's K blocks. Returns (in_v, physical page, head):
    in_v says whether the block is in the V cache; page -1 when the item ends first or distance is 0.
    """
    if distance == 0:
        return False, -1, 0
    index = (p - first) * num_heads + h + distance
    span = (last - first) * num_heads
    in_v = v_pass
    if index >= span:  # past this pass: into the chunk's V pass, or the next chunk's K pass
        index -= span
        in_v = not v_pass
        if v_pass:
            first, last = last, min(last + chunk_pages, page_end)
    page = first + index // num_heads
    if page >= last:
        return in_v, -1, 0
    return in_v, block_table[seq, page], index % num_heads


@njit(inline="always", **JIT)
def _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last, page_end, chunk_pages,
                   v_pass, distance):
    """The address of the block to prefetch while a prefill item reads page p of its KV head (an
    item's blocks are its head's pages: :func:`_block_ahead` with one head); 0: none."""
    in_v, page, _ = _block_ahead(block_table, seq, p, 0, 1, first, last, page_end, chunk_pages,
                                 v_pass, distance)
    return block_address(v_cache if in_v else k_cache, page, head)


@njit(inline="always", **JIT)
def _blocks_ahead(k_cache, v_cache, block_table, seq, p, h, num_heads, first, last, page_end,
                  chunk_pages, v_pass, distances):
    """The addresses of the blocks distances[0] and distances[1] visits after block (page p, head
    h) (see :func:`_block_ahead`): far ahead, and again nearer (kernels/prefetch.py); 0: none."""
    in_v, page, head = _block_ahead(block_table, seq, p, h, num_heads, first, last, page_end,
                                    chunk_pages, v_pass, distances[0])
    ahead = block_address(v_cache if in_v else k_cache, page, head)
    in_v, page, head = _block_ahead(block_table, seq, p, h, num_heads, first, last, page_end,
                                    chunk_pages, v_pass, distances[1])
    return ahead, block_address(v_cache if in_v else k_cache, page, head)


def _decode_kernel(kind):
    """The kernel of :func:`decode` for one ``kind`` (:func:`kernel_kind`): the FMA tiles of
    one storage (float32, float16, bfloat16, float8_e4m3fn; Numba's loops where they do not
    apply), or the vdpbf16ps tiles of bfloat16 or float8 pages (``PAIRED``, ``PAIRED_FLOAT8``).

    Each compiles only its own kind of tiles: a cold compile of decode took 27-31 s with the
    float32 and bfloat16 tiles in one kernel, 20-23 s per storage then (this VM, noisy), and a
    float32 cache never needs the bfloat16 kernel. Memory-bound speed was unchanged (S1/S2/S3,
    paired rounds: 0.99-1.02x the time).
    """
    fma = kind not in PAIR_BYTES  # FMA tiles: queries scaled float32, probabilities float32
    pair_kind = kind == "bfloat16" and PAIR_ORDER  # the tiles' rows in pair order (AVX2)

    @njit(parallel=True, **JIT)
    def decode(q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale,
               window, soft_cap, alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks, num_threads):
        num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        num_q_heads = q.shape[1]
        group = num_q_heads // num_kv_heads
        chunk_pages = max(1, CHUNK_TOKENS // page_size)
        # float32 pages: the FMA tiles. Against Numba's loops, MHA read 2-10% faster from memory and
        # 25-45% from cache (head_dim 64/80/128, 8-32 heads); GQA, with each line prefetched twice,
        # 0-18% faster from memory and 10-50% from cache (kernels/_score_tiles.py has the exceptions).
        tiles = takes_fma_tiles(k_cache) if fma else True
        dots = not fma  # the vdpbf16ps tiles' rounded queries and probabilities
        pairs = pair_kind and tiles
        # Numba's loops ask for each line once (kernels/prefetch.py): no second block address for them.
        distances = (prefetch_blocks[0], prefetch_blocks[1] if tiles else 0)
        num_slots, next_slot = slot_indptr.shape[0] - 1, slots.new_counter()
        for _ in prange(min(num_slots, num_threads)):
            qs, acc, m, l, qpos, scores = thread_scratch(num_q_heads, chunk_pages * page_size, head_dim)
            q_bits, packed = dot_scratch(num_q_heads, chunk_pages * page_size, head_dim, dots)
            slot = slots.claim(next_slot)
            while slot < num_slots:
                for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
                    seq, page_begin, page_end, part = items[item]
                    seq_len = seq_lens[seq]
                    start_decode_item(q, seq, seq_len, scale, dots, qs, q_bits, acc, m, l, qpos, pairs)
                    for first in range(page_begin, page_end, chunk_pages):
                        last = min(first + chunk_pages, page_end)
                        key0 = first * page_size
                        num_cols = min((last - first) * page_size, seq_len - key0)
                        for p in range(first, last):  # scores of every head, page by page (contiguous)
                            page = block_table[seq, p]
                            num_tokens = min(page_size, seq_len - p * page_size)
                            for head in range(num_kv_heads):
                                ahead, again = _blocks_ahead(
                                    k_cache, v_cache, block_table, seq, p, head, num_kv_heads, first, last,
                                    page_end, chunk_pages, False, distances)
                                if not tiles:
                                    plain_page_scores(qs, head * group, group, k_cache, page, head,
                                                      kv_format, num_tokens, scores,
                                                      (p - first) * page_size, ahead)
                                elif fma:  # the queries are scaled already
                                    DECODE_SCORES(kind, qs, head * group, group, k_cache, page, head,
                                                  num_tokens, np.float32(1.0), scores,
                                                  (p - first) * page_size, ahead, again)
                                else:
                                    DECODE_SCORES(kind, q_bits, head * group, group, k_cache, page,
                                                  head, num_tokens, scale, scores,
                                                  (p - first) * page_size, ahead, again)
                        masked = window > 0 and key0 <= seq_len - 1 - window
                        softmax_update(scores, 0, num_q_heads, num_cols, key0, qpos, masked, window,
                                       soft_cap, alibi_slopes, m, l, acc)
                        if dots:
                            pack_pairs(scores, 0, num_q_heads, num_cols, packed)
                        for p in range(first, last):
                            page = block_table[seq, p]
                            num_tokens = min(page_size, seq_len - p * page_size)
                            for head in range(num_kv_heads):
                                ahead, again = _blocks_ahead(
                                    k_cache, v_cache, block_table, seq, p, head, num_kv_heads, first, last,
                                    page_end, chunk_pages, True, distances)
                                if not tiles:
                                    plain_page_accumulate(scores, head * group, group,
                                                          (p - first) * page_size, v_cache, page, head,
                                                          kv_format, num_tokens, acc, ahead)
                                elif fma:
                                    DECODE_VALUES(kind, scores, head * group, group,
                                                  (p - first) * page_size, v_cache, page, head,
                                                  num_tokens, acc, ahead, again)
                                else:
                                    DECODE_VALUES(kind, packed, head * group, group,
                                                  (p - first) * page_size, v_cache, page, head,
                                                  num_tokens, acc, ahead, again)
                    for h in range(num_q_heads):
                        if part < 0:
                            lse[seq, h] = finish_row(acc[h], m[h], l[h], out[seq, h], dots, pairs=pairs)
                        else:
                            part_lse[part, h] = finish_row(acc[h], m[h], l[h], part_out[part, h], dots,
                                                           pairs=pairs)
                slot = slots.claim(next_slot)

    return decode


_DECODE = {kind: _decode_kernel(kind) for kind in KINDS}


def decode(q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale,
           window, soft_cap, alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks, *,
           dot_products):
    """Decode attention over planned work items.

    A work item is one sequence over a run of its pages, all KV heads at once: in the HND layout
    the heads of one page are adjacent, so the item reads each page as one contiguous
    ``num_kv_heads * page_size * head_dim`` run (measured: 24.5 GB/s on one core, against 13.7 GB/s
    for one head's block at a time, on random page order).

    q : float32 [num_seqs, num_q_heads, head_dim]; out : float32, same shape; lse : float32
    [num_seqs, num_q_heads]. items : int32 [num_items, 4] = (seq, page_begin, page_end, part)
    where part = -1 writes out/lse directly and part >= 0 writes part_out [num_parts,
    num_q_heads, head_dim] and part_lse [num_parts, num_q_heads] for :func:`merge_parts`.
    slot_indptr : int32 [num_slots + 1], items of slot i are items[slot_indptr[i]:slot_indptr[i + 1]].
    alibi_slopes : float32 [num_q_heads] or empty. prefetch_blocks : (int, int), how many head
    blocks ahead of the one being read (in the item's visit order, see :func:`_block_ahead`) to
    prefetch, far and again nearer (kernels/prefetch.py; 0: none). dot_products : bool, whether
    bfloat16 and float8 pages may take the vdpbf16ps tiles (query and probabilities rounded to
    bfloat16; kernels/_tile_ir.py), when the shape allows.
    """
    kind = kernel_kind(k_cache, kv_format, dot_products)
    _warm.announce_compile(_DECODE[kind], kind, "decode")
    _DECODE[kind](
        q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale, window,
        soft_cap, alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks, get_num_threads())


@njit(parallel=True, **JIT)
def merge_parts(part_out, part_lse, split_seqs, out, lse):
    """Combine the pieces of sequences split across slots by log-sum-exp.

    split_seqs : int32 [num_split, 3] = (seq, part_begin, part_end).
    """
    num_q_heads, head_dim = part_out.shape[1], part_out.shape[2]
    for j in prange(split_seqs.shape[0]):
        seq, begin, end = split_seqs[j]
        for h in range(num_q_heads):
            row = out[seq, h]
            top = -np.inf
            for p in range(begin, end):
                top = max(top, part_lse[p, h])
            row[:] = 0.0
            if top == -np.inf:
                lse[seq, h] = -np.inf
                continue
            total = np.float32(0.0)
            for p in range(begin, end):
                w = math.exp(part_lse[p, h] - top)
                total += w
                for d in range(head_dim):
                    row[d] += w * part_out[p, h, d]
            inv = np.float32(1.0) / total
            for d in range(head_dim):
                row[d] *= inv
            lse[seq, h] = top + math.log(total)


def _prefill_kernel(kind):
    """The kernel of :func:`prefill` for one storage, as :func:`_decode_kernel` is for decode: a
    cold compile of prefill took 21-22 s per storage with both kinds of tiles in one kernel,
    12-15 s since; its speed was unchanged (10 process pairs, 8 shapes: 0.99-1.03x the time)."""
    fma = kind not in PAIR_BYTES
    pair_kind = kind == "bfloat16" and PAIR_ORDER
    # float8 value blocks turned into bfloat16 once per chunk, for the bfloat16 chunk tile, where an
    # item has WIDEN_ROWS query rows (each of its 8-row tiles turned every block itself).
    widen_values = kind == PAIRED_FLOAT8
    value_kind = PAIRED if widen_values else kind

    @njit(parallel=True, **JIT)
    def prefill(q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr,
                scale, window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, num_threads):
        num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads
        max_rows = query_tokens(group) * group
        chunk_pages = max(1, CHUNK_TOKENS // page_size)
        # float32 pages: the FMA score and value tiles (compute-bound here: 1.4-1.7x faster than
        # Numba's loops, kernels/_score_tiles.py), as in decode. The queries are scaled already.
        tiles = takes_fma_tiles(k_cache) if fma else True
        dots = not fma
        pairs = pair_kind and tiles
        # The vdpbf16ps tiles' plain softmax (no soft cap, no ALiBi) in two vector passes per row,
        # straight to packed bfloat16 (kernels/_softmax_ir.py): prefill 0.98-0.99x the time on
        # the Intel Xeon with AMX off (S1, S3, G8). Decode keeps softmax_update and pack_pairs:
        # there, from cache, S3 0.93x but S1 1.03x and G8 1.06x.
        plain = soft_cap <= 0.0 and alibi_slopes.shape[0] == 0
        num_slots, next_slot = slot_indptr.shape[0] - 1, slots.new_counter()
        for _ in prange(min(num_slots, num_threads)):
            qs, acc, m, l, qpos, scores = thread_scratch(max_rows, chunk_pages * page_size, head_dim)
            q_bits, packed = dot_scratch(max_rows, chunk_pages * page_size, head_dim, dots)
            slopes = np.empty(max_rows if alibi_slopes.shape[0] > 0 else 0, np.float32)
            blocks, aheads = np.empty(chunk_pages, np.int64), np.empty(chunk_pages, np.int64)
            widened = np.empty((chunk_pages if widen_values else 0, 1, page_size, head_dim), np.uint16)
            slot = slots.claim(next_slot)
            while slot < num_slots:
                for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
                    seq, head, row_begin, row_end = items[item]
                    seq_len = seq_lens[seq]
                    num_rows, low, high, page_begin, page_end = start_prefill_item(
                        q, qo_indptr, seq, seq_len, head, row_begin, row_end, group, page_size, window,
                        scale, dots, alibi_slopes, qs, q_bits, acc, m, l, qpos, slopes, pairs)
                    widened_rows = widen_values and num_rows >= WIDEN_ROWS
                    for first in range(page_begin, page_end, chunk_pages):
                        last = min(first + chunk_pages, page_end)
                        key0 = first * page_size
                        num_cols = min((last - first) * page_size, seq_len - key0)
                        for p in range(first, last):
                            ahead = _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                   page_end, chunk_pages, False, prefetch_blocks)
                            num_tokens = min(page_size, seq_len - p * page_size)
                            if not tiles:
                                plain_page_scores(qs, 0, num_rows, k_cache, block_table[seq, p], head,
                                                  kv_format, num_tokens, scores,
                                                  (p - first) * page_size, ahead)
                            elif fma:
                                PREFILL_SCORES(kind, qs, 0, num_rows, k_cache, block_table[seq, p],
                                               head, num_tokens, np.float32(1.0), scores,
                                               (p - first) * page_size, ahead, 0)
                            else:
                                PREFILL_SCORES(kind, q_bits, 0, num_rows, k_cache, block_table[seq, p],
                                               head, num_tokens, scale, scores, (p - first) * page_size,
                                               ahead, 0)
                        if dots and plain:  # scaled by the tiles already
                            softmax_to_bf16(scores, num_rows, num_cols, key0, qpos, window,
                                            np.float32(1.0), m, l, acc, packed.view(np.uint16))
                        else:
                            masked = key0 + num_cols - 1 > low or (window > 0 and key0 <= high - window)
                            softmax_update(scores, 0, num_rows, num_cols, key0, qpos, masked, window,
                                           soft_cap, slopes, m, l, acc)
                            if dots:
                                pack_pairs(scores, 0, num_rows, num_cols, packed)
                        for p in range(first, last):  # the tiles take the chunk's blocks at once
                            ahead = _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                   page_end, chunk_pages, True, prefetch_blocks)
                            if tiles and widened_rows:
                                blocks[p - first] = block_address(widened, p - first, 0)
                                aheads[p - first] = 0
                                widen_into(block_address(v_cache, block_table[seq, p], head),
                                           min(page_size, seq_len - p * page_size) * head_dim,
                                           blocks[p - first], ahead)
                            elif tiles:
                                blocks[p - first] = block_address(v_cache, block_table[seq, p], head)
                                aheads[p - first] = ahead
                            else:
                                plain_page_accumulate(scores, 0, num_rows, (p - first) * page_size,
                                                      v_cache, block_table[seq, p], head, kv_format,
                                                      min(page_size, seq_len - p * page_size), acc, ahead)
                        last_tokens = min(page_size, seq_len - (last - 1) * page_size)
                        if tiles and fma:
                            PREFILL_CHUNK_VALUES(kind, scores, 0, num_rows, v_cache, blocks, aheads,
                                                 last - first, last_tokens, acc)
                        elif tiles and widened_rows:
                            PREFILL_CHUNK_VALUES(value_kind, packed, 0, num_rows, widened, blocks,
                                                 aheads, last - first, last_tokens, acc)
                        elif tiles:
                            PREFILL_CHUNK_VALUES(kind, packed, 0, num_rows, v_cache, blocks, aheads,
                                                 last - first, last_tokens, acc)
                    for i in range(row_end - row_begin):
                        for g in range(group):
                            r = i * group + g
                            lse[row_begin + i, head * group + g] = finish_row(
                                acc[r], m[r], l[r], out[row_begin + i, head * group + g], dots,
                                pairs=pairs)
                slot = slots.claim(next_slot)

    return prefill


_PREFILL = {kind: _prefill_kernel(kind) for kind in KINDS}


def prefill(q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr,
            scale, window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, *, dot_products):
    """Causal attention of each sequence's new tokens over its whole paged context.

    q, out : float32 [num_tokens, num_q_heads, head_dim]; lse : float32 [num_tokens, num_q_heads].
    Sequence s owns q rows qo_indptr[s]:qo_indptr[s+1], the last of its seq_lens[s] positions.
    items : int32 [num_items, 4] = (seq, kv_head, row_begin, row_end), at most
    query_tokens(group) rows.
    prefetch_blocks : int, the far distance of :func:`decode` (an item's blocks are its head's
    pages); the tiles are not asked again nearer: that made prefill 1-4% slower (compute-bound).
    dot_products : bool, as in :func:`decode`.
    """
    kind = kernel_kind(k_cache, kv_format, dot_products)
    _warm.announce_compile(_PREFILL[kind], kind, "prefill")
    _PREFILL[kind](
        q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr, scale,
        window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, get_num_threads())
