"""Paged attention kernels: decode (one query token per sequence) and prefill (ragged, causal).

Layout (docs/layout.md): ``k_cache``, ``v_cache`` are ``[num_pages, num_kv_heads, page_size,
head_dim]``; one page of one head is a contiguous ``[page_size, head_dim]`` block. The kernels walk
``block_table [num_seqs, max_pages]`` (int32 physical page ids) and trust their input: the wrappers
in ``pagekv.attention`` validate it.

How the work is shaped:

- A *work item* is one KV head of one sequence over a run of its pages. The ``G`` query heads of a
  GQA group are processed together, so each K/V page is read from memory once per group.
- Online softmax is folded once per page: the page's scores are computed first, then the running
  max, sum and accumulator are rescaled once (the design note rescaled on every new maximum token).
- Work items are assigned to ``num_slots`` slots (one per thread) by a planner that balances pages,
  cutting long sequences into pieces (flash-decoding); pieces are merged by log-sum-exp. The
  parallel loop runs over slots, so no thread waits for another's long sequence.
- Per-thread scratch is allocated once per slot per call, never inside the page loop.
"""

import math

import numpy as np
from numba import njit, prange

from pagekv.kernels._dtypes import page_as_f32

# Not fastmath=True: that implies no-NaN/no-inf and would break -inf masking. These flags let LLVM
# reorder sums (vectorised dot products) and fuse multiply-adds, and nothing more.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
QUERY_BLOCK = 16  # prefill query tokens per work item

_JIT = dict(cache=True, fastmath=FASTMATH, error_model="numpy", nogil=True)


@njit(inline="always", **_JIT)
def _fold_page(qs, num_rows, kb, vb, num_tokens, key0, qpos, masked, window, soft_cap, slopes,
               m, l, acc, scores):
    """Fold one page into the running softmax state of ``num_rows`` query rows.

    qs : float32 [rows, head_dim], queries already multiplied by the scale.
    kb, vb : float32 [page_size, head_dim], the page's keys and values (first num_tokens valid).
    key0 : position of the page's first token in its sequence.
    qpos : int64 [rows], each row's query position; masked: whether this page needs masking.
    slopes : float32 [rows] ALiBi slopes, or an empty array for none.
    m, l : float32 [rows], running max and sum; acc : float32 [rows, head_dim].
    scores : float32 [rows, page_size] scratch.
    """
    head_dim = qs.shape[1]
    for t in range(num_tokens):
        for r in range(num_rows):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += qs[r, d] * kb[t, d]
            scores[r, t] = s
    if soft_cap > 0.0:
        for r in range(num_rows):
            for t in range(num_tokens):
                scores[r, t] = soft_cap * math.tanh(scores[r, t] / soft_cap)
    if slopes.shape[0] > 0:
        for r in range(num_rows):
            for t in range(num_tokens):
                scores[r, t] += slopes[r] * np.float32(key0 + t - qpos[r])
    if masked:
        for r in range(num_rows):
            for t in range(num_tokens):
                k = key0 + t
                if k > qpos[r] or (window > 0 and k <= qpos[r] - window):
                    scores[r, t] = -np.inf
    for r in range(num_rows):
        page_max = -np.inf
        for t in range(num_tokens):
            page_max = max(page_max, scores[r, t])
        if page_max == -np.inf:  # every key of this page is masked for this row
            for t in range(num_tokens):
                scores[r, t] = 0.0
            continue
        new_max = max(m[r], page_max)
        alpha = math.exp(m[r] - new_max)  # exp(-inf) = 0 on the first page
        total = np.float32(0.0)
        for t in range(num_tokens):
            p = math.exp(scores[r, t] - new_max)
            scores[r, t] = p
            total += p
        l[r] = l[r] * alpha + total
        m[r] = new_max
        if alpha != 1.0:
            for d in range(head_dim):
                acc[r, d] *= alpha
    for t in range(num_tokens):
        for r in range(num_rows):
            p = scores[r, t]
            for d in range(head_dim):
                acc[r, d] += p * vb[t, d]


@njit(inline="always", **_JIT)
def _finish_row(acc_row, m_r, l_r, out_row):
    """Write acc / l to out_row and return the row's log-sum-exp (-inf and zeros if nothing attended)."""
    if l_r == 0.0:
        out_row[:] = 0.0
        return -np.inf
    inv = np.float32(1.0) / l_r
    for d in range(acc_row.shape[0]):
        out_row[d] = acc_row[d] * inv
    return m_r + math.log(l_r)


@njit(parallel=True, **_JIT)
def decode(q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale,
           window, soft_cap, alibi_slopes, out, lse, part_out, part_lse):
    """Decode attention over planned work items.

    q : float32 [num_seqs, num_q_heads, head_dim]; out : float32, same shape; lse : float32
    [num_seqs, num_q_heads]. items : int32 [num_items, 5] = (seq, kv_head, page_begin, page_end,
    part) where part = -1 writes out/lse directly and part >= 0 writes part_out [num_parts, G,
    head_dim] and part_lse [num_parts, G] for :func:`merge_parts`. slot_indptr : int32
    [num_slots + 1], items of slot i are items[slot_indptr[i]:slot_indptr[i + 1]].
    alibi_slopes : float32 [num_q_heads] or empty.
    """
    num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    for slot in prange(slot_indptr.shape[0] - 1):
        qs = np.empty((group, head_dim), np.float32)
        acc = np.empty((group, head_dim), np.float32)
        m = np.empty(group, np.float32)
        l = np.empty(group, np.float32)
        scores = np.empty((group, page_size), np.float32)
        k_scratch = np.empty((page_size, head_dim), np.float32)
        v_scratch = np.empty((page_size, head_dim), np.float32)
        qpos = np.empty(group, np.int64)
        slopes = np.empty(group if alibi_slopes.shape[0] > 0 else 0, np.float32)
        for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
            seq, head, page_begin, page_end, part = items[item]
            seq_len = seq_lens[seq]
            for g in range(group):
                for d in range(head_dim):
                    qs[g, d] = q[seq, head * group + g, d] * scale
                    acc[g, d] = 0.0
                m[g] = -np.inf
                l[g] = 0.0
                qpos[g] = seq_len - 1
                if slopes.shape[0] > 0:
                    slopes[g] = alibi_slopes[head * group + g]
            for p in range(page_begin, page_end):
                page = block_table[seq, p]
                key0 = p * page_size
                num_tokens = min(page_size, seq_len - key0)
                masked = window > 0 and key0 <= seq_len - 1 - window
                kb = page_as_f32(k_cache, page, head, num_tokens, kv_format, k_scratch)
                vb = page_as_f32(v_cache, page, head, num_tokens, kv_format, v_scratch)
                _fold_page(qs, group, kb, vb, num_tokens, key0, qpos, masked, window, soft_cap,
                           slopes, m, l, acc, scores)
            for g in range(group):
                if part < 0:
                    lse[seq, head * group + g] = _finish_row(acc[g], m[g], l[g],
                                                             out[seq, head * group + g])
                else:
                    part_lse[part, g] = _finish_row(acc[g], m[g], l[g], part_out[part, g])


@njit(parallel=True, **_JIT)
def merge_parts(part_out, part_lse, split_pairs, out, lse):
    """Combine the pieces of split (sequence, KV head) pairs by log-sum-exp.

    split_pairs : int32 [num_split, 4] = (seq, kv_head, part_begin, part_end).
    """
    group, head_dim = part_out.shape[1], part_out.shape[2]
    for j in prange(split_pairs.shape[0]):
        seq, head, begin, end = split_pairs[j]
        for g in range(group):
            row = out[seq, head * group + g]
            top = -np.inf
            for p in range(begin, end):
                top = max(top, part_lse[p, g])
            row[:] = 0.0
            if top == -np.inf:
                lse[seq, head * group + g] = -np.inf
                continue
            total = np.float32(0.0)
            for p in range(begin, end):
                w = math.exp(part_lse[p, g] - top)
                total += w
                for d in range(head_dim):
                    row[d] += w * part_out[p, g, d]
            inv = np.float32(1.0) / total
            for d in range(head_dim):
                row[d] *= inv
            lse[seq, head * group + g] = top + math.log(total)


@njit(parallel=True, **_JIT)
def prefill(q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr,
            scale, window, soft_cap, alibi_slopes, out, lse):
    """Causal attention of each sequence's new tokens over its whole paged context.

    q, out : float32 [num_tokens, num_q_heads, head_dim]; lse : float32 [num_tokens, num_q_heads].
    Sequence s owns q rows qo_indptr[s]:qo_indptr[s+1], the last of its seq_lens[s] positions.
    items : int32 [num_items, 4] = (seq, kv_head, row_begin, row_end), at most QUERY_BLOCK rows.
    """
    num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    max_rows = QUERY_BLOCK * group
    for slot in prange(slot_indptr.shape[0] - 1):
        qs = np.empty((max_rows, head_dim), np.float32)
        acc = np.empty((max_rows, head_dim), np.float32)
        m = np.empty(max_rows, np.float32)
        l = np.empty(max_rows, np.float32)
        scores = np.empty((max_rows, page_size), np.float32)
        k_scratch = np.empty((page_size, head_dim), np.float32)
        v_scratch = np.empty((page_size, head_dim), np.float32)
        qpos = np.empty(max_rows, np.int64)
        slopes = np.empty(max_rows if alibi_slopes.shape[0] > 0 else 0, np.float32)
        for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
            seq, head, row_begin, row_end = items[item]
            seq_len = seq_lens[seq]
            first_pos = seq_len - (qo_indptr[seq + 1] - qo_indptr[seq])  # position of row qo_indptr[seq]
            num_rows = (row_end - row_begin) * group
            for i in range(row_end - row_begin):
                for g in range(group):
                    r = i * group + g
                    for d in range(head_dim):
                        qs[r, d] = q[row_begin + i, head * group + g, d] * scale
                        acc[r, d] = 0.0
                    m[r] = -np.inf
                    l[r] = 0.0
                    qpos[r] = first_pos + row_begin - qo_indptr[seq] + i
                    if slopes.shape[0] > 0:
                        slopes[r] = alibi_slopes[head * group + g]
            low, high = qpos[0], qpos[num_rows - 1]
            page_begin = max(low - window + 1, 0) // page_size if window > 0 else 0
            for p in range(page_begin, high // page_size + 1):
                page = block_table[seq, p]
                key0 = p * page_size
                num_tokens = min(page_size, seq_len - key0)
                masked = key0 + num_tokens - 1 > low or (window > 0 and key0 <= high - window)
                kb = page_as_f32(k_cache, page, head, num_tokens, kv_format, k_scratch)
                vb = page_as_f32(v_cache, page, head, num_tokens, kv_format, v_scratch)
                _fold_page(qs, num_rows, kb, vb, num_tokens, key0, qpos, masked, window, soft_cap,
                           slopes, m, l, acc, scores)
            for i in range(row_end - row_begin):
                for g in range(group):
                    r = i * group + g
                    lse[row_begin + i, head * group + g] = _finish_row(
                        acc[r], m[r], l[r], out[row_begin + i, head * group + g])
