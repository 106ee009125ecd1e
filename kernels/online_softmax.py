"""A work item's working rows and its online softmax: each row's query set up, the running max,
sum and accumulator folded once per chunk of pages, and the output written at the end.

Row r of a work item is one query head of one query token (decode: query head r of the
sequence; prefill: token i of the item, head g of its GQA group, r = i * group + g). The
softmax is folded once per chunk of keys (kernels/attention.py, CHUNK_TOKENS), never per token
(the design note rescaled the accumulator on every new maximum).
"""

import math

import numpy as np
from numba import njit

from pagekv.kernels import _amx, _softmax_ir
from pagekv.kernels._math import FASTMATH, JIT, fast_exp, fmax
from pagekv.kernels._tile_rows import pair_dim, pair_position, to_bf16, value_dim


@njit(cache=True, fastmath=FASTMATH | {"nnan"}, error_model="numpy", nogil=True)
def _row_max(scores, r, n):
    """max(scores[r, :n]) as float32 (-inf if n == 0; scores hold no NaN).

    ``fmax`` (llvm.maxnum) vectorises; Python's ``max`` compiled to a scalar float64 chain, ~70% of
    the softmax's time. "nnan" lets maxnum be a bare vmaxps (no NaN fix-ups: the softmax 20%
    faster), so this loop is not inlined: inlined code takes its caller's flags."""
    top = np.float32(-np.inf)
    for t in range(n):
        top = fmax(top, scores[r, t])
    return top


# The chunk routines are separate functions, not inlined: compiled on their own, LLVM vectorises
# their loops; inlined into the parallel loop body, it did not (measured: scalar FMAs only).
@njit(**JIT)
def softmax_update(scores, r0, num_rows, num_cols, key0, qpos, masked, window, soft_cap, slopes,
                    m, l, acc):
    """Turn scores[r0:r0+num_rows, :num_cols] into probabilities and rescale the running state.

    The columns are the keys at positions key0 .. key0 + num_cols - 1 (a chunk of pages); the
    online softmax is folded once per chunk, never per token. qpos : int64 [rows], each row's query
    position (indexed from r0); slopes : float32 ALiBi slopes by row, or empty; m, l : float32
    running max and sum; acc : float32 [rows, head_dim] running output, rescaled here.
    """
    if soft_cap > 0.0:
        for r in range(r0, r0 + num_rows):
            for t in range(num_cols):
                scores[r, t] = soft_cap * math.tanh(scores[r, t] / soft_cap)
    if slopes.shape[0] > 0:
        for r in range(r0, r0 + num_rows):
            for t in range(num_cols):
                scores[r, t] += slopes[r] * np.float32(key0 + t - qpos[r])
    if masked:
        for r in range(r0, r0 + num_rows):
            for t in range(num_cols):
                k = key0 + t
                if k > qpos[r] or (window > 0 and k <= qpos[r] - window):
                    scores[r, t] = -np.inf
    for r in range(r0, r0 + num_rows):
        chunk_max = _row_max(scores, r, num_cols)
        if chunk_max == -np.inf:  # every key of this chunk is masked for this row
            for t in range(num_cols):
                scores[r, t] = 0.0
            continue
        new_max = max(m[r], chunk_max)
        total = np.float32(0.0)
        for t in range(num_cols):
            p = fast_exp(scores[r, t] - new_max)
            scores[r, t] = p
            total += p
        _fold(r, new_max, total, m, l, acc)


@njit(inline="always", **JIT)
def _fold(r, new_max, total, m, l, acc):
    """Row r's running state after a chunk whose probabilities (taken against new_max) sum to
    total: its sum and accumulator rescaled by exp(m[r] - new_max), then the max moved up."""
    alpha = fast_exp(m[r] - new_max)  # exp(-inf) = 0 on the first chunk
    l[r] = l[r] * alpha + total
    m[r] = new_max
    if alpha != 1.0:
        for d in range(acc.shape[1]):
            acc[r, d] *= alpha


@njit(**JIT)
def softmax_to_bf16(scores, num_rows, num_cols, key0, qpos, window, scale, m, l, acc, probs):
    """:func:`softmax_update` of unscaled scores with no soft cap and no ALiBi, its probabilities
    rounded to bfloat16 into ``probs`` (as :func:`pagekv.kernels._tile_rows.pack_pairs` would,
    from the same float32 values; 0 for the masked keys and up to the next multiple of 32 keys),
    ``scores`` left as they were: two passes per row in 512-bit vectors (kernels/_softmax_ir.py).

    scores : float32 [rows, >= num_cols], the keys at positions key0 .. key0 + num_cols - 1 times
    each row's query, not yet multiplied by ``scale``; qpos : int64 [rows]; window : sliding
    window, 0 for none (with the causal mask, each row's keys are one run of columns); m, l :
    float32 [rows], in units of the scaled scores; acc : float32 [rows, head_dim], rescaled here;
    probs : uint16 [rows, >= num_cols rounded up to 32].
    """
    padded = min(-(-num_cols // 32) * 32, probs.shape[1])
    s_step, p_step = scores.strides[0], probs.strides[0]
    for r in range(num_rows):
        end = min(num_cols, qpos[r] - key0 + 1)  # causal: no key past the row's own position
        begin = max(0, qpos[r] - window + 1 - key0) if window > 0 else 0
        if end <= begin:  # every key of this chunk is masked for this row
            probs[r, :padded] = 0
            continue
        row = scores.ctypes.data + r * s_step + begin * 4
        new_max = max(m[r], _softmax_ir.scaled_max(row, end - begin, scale))
        total = _softmax_ir.exp_to_bf16(row, end - begin, scale, new_max,
                                        probs.ctypes.data + r * p_step + begin * 2)
        probs[r, :begin] = 0
        probs[r, end:padded] = 0
        _fold(r, new_max, total, m, l, acc)


@njit(**JIT)
def thread_scratch(rows, cols, head_dim):
    """A thread's working arrays, allocated once per kernel call and thread (once per slot in the
    AMX kernels), never per page: scaled queries and accumulators [rows, head_dim], running max
    and sum [rows], query positions [rows] and scores [rows, cols]."""
    return (np.empty((rows, head_dim), np.float32), np.empty((rows, head_dim), np.float32),
            np.empty(rows, np.float32), np.empty(rows, np.float32), np.empty(rows, np.int64),
            np.empty((rows, cols), np.float32))


@njit(**JIT)
def dot_scratch(rows, cols, head_dim, dot_products):
    """The bfloat16 path's working arrays (empty when it is not taken): the queries rounded to
    bfloat16, uint16 [rows, head_dim], and the packed probabilities, uint32 [rows, cols // 2 + 1]."""
    if not dot_products:
        rows = 0
    return np.empty((rows, head_dim), np.uint16), np.empty((rows, cols // 2 + 1), np.uint32)


@njit(inline="always", **JIT)
def _start_row(q, token, q_head, r, scale, dots, qs, q_bits, acc, m, l, pairs=False):
    """Set up working row r for query q[token, q_head]: its running max, sum and accumulator
    cleared, and the query itself — scaled in float32 (qs) for the FMA tiles and Numba's loops
    (in pair order with ``pairs``: the bfloat16 FMA tiles' on AVX2, :func:`pair_dim`), or
    rounded to bfloat16 and not scaled (q_bits) for the vdpbf16ps tiles, which scale the scores,
    so a bfloat16 query stays exact."""
    for d in range(acc.shape[1]):
        acc[r, d] = 0.0
        if dots:
            q_bits[r, d] = to_bf16(q[token, q_head, d])
        else:
            qs[r, pair_position(d) if pairs else d] = q[token, q_head, d] * scale
    m[r] = -np.inf
    l[r] = 0.0


@njit(inline="always", **JIT)
def start_decode_item(q, seq, seq_len, scale, dots, qs, q_bits, acc, m, l, qpos, pairs=False):
    """Set up a decode item's working rows: row h for query head h of sequence seq
    (:func:`_start_row`), every row at the sequence's last position."""
    for h in range(q.shape[1]):
        _start_row(q, seq, h, h, scale, dots, qs, q_bits, acc, m, l, pairs)
    qpos[:] = seq_len - 1


@njit(inline="always", **JIT)
def start_prefill_item(q, qo_indptr, seq, seq_len, head, row_begin, row_end, group, page_size,
                       window, scale, dots, alibi_slopes, qs, q_bits, acc, m, l, qpos, slopes,
                       pairs=False):
    """Set up a prefill item's working rows (query token i of the item, head g of the group: row
    i * group + g) with their query positions and ALiBi slopes (if any), and return (num_rows,
    lowest and highest query position, first and end page the rows see)."""
    first_pos = seq_len - (qo_indptr[seq + 1] - qo_indptr[seq])  # position of row qo_indptr[seq]
    for i in range(row_end - row_begin):
        for g in range(group):
            r = i * group + g
            _start_row(q, row_begin + i, head * group + g, r, scale, dots, qs, q_bits, acc, m, l,
                       pairs)
            qpos[r] = first_pos + row_begin - qo_indptr[seq] + i
            if slopes.shape[0] > 0:
                slopes[r] = alibi_slopes[head * group + g]
    num_rows = (row_end - row_begin) * group
    low, high = qpos[0], qpos[num_rows - 1]
    page_begin = max(low - window + 1, 0) // page_size if window > 0 else 0
    return num_rows, low, high, page_begin, high // page_size + 1


@njit(inline="always", **JIT)
def finish_row(acc_row, m_r, l_r, out_row, dots, amx_sums=False, pairs=False):
    """Write acc / l to out_row and return the row's log-sum-exp (-inf and zeros if nothing attended).

    dots: the accumulators are the vdpbf16ps value tiles', their dimensions in the order of
    :func:`value_dim`; amx_sums: the AMX value tiles' (:func:`_amx.acc_dim`); pairs: the
    bfloat16 FMA tiles' pair order (:func:`pair_dim`). Each is put back in order here, once
    per row."""
    if l_r == 0.0:
        out_row[:] = 0.0
        return -np.inf
    inv = np.float32(1.0) / l_r
    head_dim = acc_row.shape[0]
    for j in range(head_dim):
        if amx_sums:
            d = _amx.acc_dim(j)
        elif dots:
            d = value_dim(j, head_dim)
        else:
            d = pair_dim(j) if pairs else j
        out_row[d] = acc_row[j] * inv
    return m_r + math.log(l_r)
