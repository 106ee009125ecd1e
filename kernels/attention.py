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
  (the design note rescaled on every new maximum token).
- Work items are assigned to ``num_slots`` slots of equal cost by a planner that balances pages,
  cutting long sequences into pieces (flash-decoding); pieces are merged by log-sum-exp. The
  threads claim the slots one by one as they come free (kernels/slots.py: a few per thread), so
  no thread waits for another's long sequence, nor for a thread the machine runs slower.
- While a block (one page of one KV head) is read, the block a fixed distance ahead in the item's
  visit order is prefetched into L2, a few lines per token row (kernels/prefetch.py says why: it
  took S1 decode from ~50% to ~80% of the streaming-read bandwidth); decode's tiles ask again for
  a nearer block, as the CPU drops some prefetches (S1/S2 bfloat16 then read ~85%).
- bfloat16 pages (head_dim a multiple of 16, even page size) multiply in bfloat16 with
  ``vdpbf16ps`` tiles (kernels/_bf16_dot.py) where the CPU has them and ``fast_bf16`` allows:
  the queries and the probabilities are rounded to bfloat16 once, the sums stay float32. In
  float32 math the bfloat16 loops were bound by the CPU's multiply-adds below the memory roof;
  the tiles made S1 decode ~1.6x faster from cache. Prefill over float32 pages (head_dim a
  multiple of 16) computes scores and values by float32 FMA tiles of the same shapes: 1.4-1.7x
  faster there than Numba's loops; decode too (see :func:`decode`). float16 pages, and bfloat16
  pages not taking ``vdpbf16ps``, take the same FMA tiles, each row widened as it is loaded
  (:func:`_kernel_kind` picks). Numba's loops serve head_dim not a multiple of 16. On CPUs with
  AMX-BF16, bfloat16 prefill and decode with GQA groups of 2-16 take AMX tiles instead (kernels/amx_attention.py; ``pagekv.attention`` picks the kernel).
- Per-thread scratch is allocated once per thread per call, never inside the page loop.
"""

import math
from typing import Any

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.extending import overload

from pagekv.kernels import _amx, slots
from pagekv.kernels import _bf16_dot as bf16
from pagekv.kernels._dtypes import FORMAT_BFLOAT16, FORMAT_FLOAT16, FORMAT_FLOAT32, load_f32
from pagekv.kernels._math import fast_exp, fmax
from pagekv.kernels.prefetch import block_address, prefetch_rows as _prefetch_rows

# Not fastmath=True: that implies no-NaN/no-inf and would break -inf masking. These flags let LLVM
# reorder sums (vectorised dot products) and fuse multiply-adds, and nothing more.
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
QUERY_BLOCK = 16  # prefill query tokens per work item
# Keys per online-softmax update: pages are folded in chunks of this many tokens (whole pages), so
# small pages do not pay the per-update costs (max, rescale of the accumulators) every 16 tokens.
# Measured on S1 (float32, page 16): 15.5 GB/s folding per page, 17.9 per 64 tokens, 19.1 per 128,
# 19.5 per 256 (S3: 26.1 -> 35.2); page 128 folded per page had reached 23.7.
CHUNK_TOKENS = 256

_JIT: dict[str, Any] = dict(cache=True, fastmath=FASTMATH, error_model="numpy", nogil=True)


@njit(**_JIT)
def _page_scores(qs, r0, num_rows, kc, kp, kh, kv_format, num_tokens, scores, col, ahead):
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


@njit(**_JIT)
def _page_accumulate(scores, r0, num_rows, col, vc, vp, vh, kv_format, num_tokens, acc, ahead):
    """acc[r0 + r] += sum over t of scores[r0 + r, col + t] * vc[vp, vh, t].

    Four value rows per pass over four accumulator rows at once: each value load feeds four
    multiply-adds and each accumulator load and store sixteen (rows left over: four value rows per
    pass over one accumulator row; the last num_tokens % 4 value rows: one at a time, every
    accumulator row). Prefetches like :func:`_page_scores`.
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


def _tiled_loops(kind, *, inline=True):
    """The page loops over register tiles of one kind, fixed when a kernel is compiled: float32 or
    float16 pages (``kind``) by FMA tiles, or bfloat16 pages by vdpbf16ps tiles.

    The tiles are picked here, in Python, so each kernel compiles one kind of tiles, not both.
    ``inline`` False compiles the loops as functions of their own, called per page, not inlined
    into the kernel.
    """
    jit = njit(inline="always" if inline else "never", **_JIT)
    four_keys, one_key, values = {"float32": (bf16.qk_f32_x4, bf16.qk_f32_x1, bf16.pv_f32),
                                  "float16": (bf16.qk_f16_x4, bf16.qk_f16_x1, bf16.pv_f16),
                                  "bfloat16": (bf16.qk_bf16_x4, bf16.qk_bf16_x1, bf16.pv_bf16),
                                  bf16.PAIRED: (bf16.qk_x4, bf16.qk_x1, bf16.pv)}[kind]
    pairs = kind == bf16.PAIRED  # probabilities packed two tokens to a word

    @jit
    def page_scores(q, r0, num_rows, kc, kp, kh, num_tokens, scale, scores, col, ahead, again):
        """:func:`_page_scores` by register tiles (kernels/_bf16_dot.py), head_dim a multiple of 16:
        bfloat16 pages by vdpbf16ps, or float32 or float16 pages by FMAs (``kind``).

        q : uint16 [rows, head_dim], the queries rounded to bfloat16 and not scaled (bfloat16
        pages), or float32 (the others); the scores are multiplied by ``scale``. Tiles of 4 query
        rows x 4 key rows; the rows left over take one tile of 3, 2 or 1 rows, the page's last
        num_tokens % 4 keys one key at a time.
        Each key row's lines of the blocks at addresses ``ahead`` and ``again`` (0: none) are
        prefetched by the first row tile.
        """
        head_dim = kc.shape[3]
        k_row, q_row, s_row = kc.strides[2], q.strides[0], scores.strides[0]
        block = block_address(kc, kp, kh)
        r = r0
        while r < r0 + num_rows:
            rows = min(bf16.MAX_ROWS, r0 + num_rows - r)
            q_r = q.ctypes.data + r * q_row
            out = scores.ctypes.data + r * s_row + col * 4
            for t in range(0, num_tokens, 4):
                pf = ahead + t * k_row if (ahead != 0 and r == r0) else 0
                pf_again = again + t * k_row if (again != 0 and r == r0) else 0
                k_t, out_t = block + t * k_row, out + t * 4
                if t + 4 <= num_tokens:
                    four_keys(rows, q_r, q_row, k_t, k_row, head_dim, scale, out_t, s_row, pf, pf_again)
                    continue
                for u in range(t, num_tokens):
                    pf_u = pf + (u - t) * k_row if pf != 0 else 0
                    again_u = pf_again + (u - t) * k_row if pf_again != 0 else 0
                    one_key(rows, q_r, q_row, block + u * k_row, k_row, head_dim, scale, out + u * 4,
                            s_row, pf_u, again_u)
            r += rows

    @jit
    def page_accumulate(probs, r0, num_rows, col, vc, vp, vh, num_tokens, acc, ahead, again):
        """:func:`_page_accumulate` by register tiles of 4 accumulator rows (3, 2 or 1 for the rest),
        head_dim a multiple of 16: bfloat16 pages by vdpbf16ps, two tokens per instruction (col
        even), or float32 or float16 pages by FMAs (``kind``).

        probs : uint32 [rows, pairs], the probabilities packed by :func:`bf16.pack_pairs`, or float32
        [rows, cols], the probabilities themselves (the scores array). The first row tile prefetches
        the blocks at addresses ``ahead`` and ``again`` (0: none).
        """
        head_dim = vc.shape[3]
        block = block_address(vc, vp, vh)
        a_row, p_row = acc.strides[0], probs.strides[0]
        first_prob = (col // 2) * 4 if pairs else col * 4
        r = r0
        while r < r0 + num_rows:
            rows = min(bf16.MAX_ROWS, r0 + num_rows - r)
            pf, pf_again = (ahead, again) if r == r0 else (0, 0)
            a, p = acc.ctypes.data + r * a_row, probs.ctypes.data + r * p_row + first_prob
            values(rows, a, a_row, block, vc.strides[2], p, p_row, num_tokens, head_dim, pf, pf_again)
            r += rows

    return page_scores, page_accumulate


# The kernel kinds: the FMA tiles of each storage (kernels/_dtypes.py), and the vdpbf16ps tiles.
_STORAGE = {FORMAT_FLOAT32: "float32", FORMAT_FLOAT16: "float16", FORMAT_BFLOAT16: "bfloat16"}
_KINDS = (*_STORAGE.values(), bf16.PAIRED)
_TILED = {kind: _tiled_loops(kind) for kind in _KINDS}
# Prefill's vdpbf16ps kernel calls its tile loops as functions: inlined into a kernel of its own
# (:func:`_prefill_kernel`) they ran 5-13% slower (8/2x64, 32/8x128, 16/16x64, 12 process pairs),
# called they run as fast as they did inlined into the old kernel that held both kinds (0.99-1.01),
# and compile 2 s faster. Decode keeps them inlined: called, it was 6-16% slower from cache.
_PREFILL_TILED = dict(_TILED, **{bf16.PAIRED: _tiled_loops(bf16.PAIRED, inline=False)})


def _kernel_kind(k_cache, kv_format, dot_products):
    """The kind of kernel that serves these pages: the vdpbf16ps tiles (``bf16.PAIRED``) for
    bfloat16 pages when ``dot_products`` allows and the shape takes them (head_dim a multiple of
    16, an even page size, so every page starts on a packed probability pair); otherwise the
    storage's own FMA tiles (Numba's loops where head_dim is not a multiple of 16)."""
    if (dot_products and kv_format == FORMAT_BFLOAT16 and k_cache.shape[3] % bf16.LANES == 0
            and k_cache.shape[2] % 2 == 0):
        return bf16.PAIRED
    return _STORAGE[kv_format]

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

    return page_scores, page_accumulate


_DECODE_SCORES, _DECODE_VALUES = _by_storage(_TILED)
_PREFILL_SCORES, _PREFILL_VALUES = _by_storage(_PREFILL_TILED)


@njit(inline="always", **_JIT)
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


@njit(inline="always", **_JIT)
def _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last, page_end, chunk_pages,
                   v_pass, distance):
    """The address of the block to prefetch while a prefill item reads page p of its KV head (an
    item's blocks are its head's pages: :func:`_block_ahead` with one head); 0: none."""
    in_v, page, _ = _block_ahead(block_table, seq, p, 0, 1, first, last, page_end, chunk_pages,
                                 v_pass, distance)
    return block_address(v_cache if in_v else k_cache, page, head)


@njit(inline="always", **_JIT)
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
@njit(**_JIT)
def _softmax_update(scores, r0, num_rows, num_cols, key0, qpos, masked, window, soft_cap, slopes,
                    m, l, acc):
    """Turn scores[r0:r0+num_rows, :num_cols] into probabilities and rescale the running state.

    The columns are the keys at positions key0 .. key0 + num_cols - 1 (a chunk of pages); the
    online softmax is folded once per chunk, never per token. qpos : int64 [rows], each row's query
    position (indexed from r0); slopes : float32 ALiBi slopes by row, or empty; m, l : float32
    running max and sum; acc : float32 [rows, head_dim] running output, rescaled here.
    """
    head_dim = acc.shape[1]
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
        alpha = fast_exp(m[r] - new_max)  # exp(-inf) = 0 on the first chunk
        total = np.float32(0.0)
        for t in range(num_cols):
            p = fast_exp(scores[r, t] - new_max)
            scores[r, t] = p
            total += p
        l[r] = l[r] * alpha + total
        m[r] = new_max
        if alpha != 1.0:
            for d in range(head_dim):
                acc[r, d] *= alpha


@njit(**_JIT)
def _thread_scratch(rows, cols, head_dim):
    """A thread's working arrays, allocated once per kernel call and thread (once per slot in the
    AMX kernels), never per page: scaled queries and accumulators [rows, head_dim], running max
    and sum [rows], query positions [rows] and scores [rows, cols]."""
    return (np.empty((rows, head_dim), np.float32), np.empty((rows, head_dim), np.float32),
            np.empty(rows, np.float32), np.empty(rows, np.float32), np.empty(rows, np.int64),
            np.empty((rows, cols), np.float32))


@njit(**_JIT)
def _dot_scratch(rows, cols, head_dim, dot_products):
    """The bfloat16 path's working arrays (empty when it is not taken): the queries rounded to
    bfloat16, uint16 [rows, head_dim], and the packed probabilities, uint32 [rows, cols // 2 + 1]."""
    if not dot_products:
        rows = 0
    return np.empty((rows, head_dim), np.uint16), np.empty((rows, cols // 2 + 1), np.uint32)


@njit(inline="always", **_JIT)
def _start_row(q, token, q_head, r, scale, dots, qs, q_bits, acc, m, l, pairs=False):
    """Set up working row r for query q[token, q_head]: its running max, sum and accumulator
    cleared, and the query itself — scaled in float32 (qs) for the FMA tiles and Numba's loops
    (in pair order with ``pairs``: the bfloat16 FMA tiles' on AVX2, :func:`bf16.pair_dim`), or
    rounded to bfloat16 and not scaled (q_bits) for the vdpbf16ps tiles, which scale the scores,
    so a bfloat16 query stays exact."""
    for d in range(acc.shape[1]):
        acc[r, d] = 0.0
        if dots:
            q_bits[r, d] = bf16.to_bf16(q[token, q_head, d])
        else:
            qs[r, bf16.pair_position(d) if pairs else d] = q[token, q_head, d] * scale
    m[r] = -np.inf
    l[r] = 0.0


@njit(inline="always", **_JIT)
def _start_decode_item(q, seq, seq_len, scale, dots, qs, q_bits, acc, m, l, qpos, pairs=False):
    """Set up a decode item's working rows: row h for query head h of sequence seq
    (:func:`_start_row`), every row at the sequence's last position."""
    for h in range(q.shape[1]):
        _start_row(q, seq, h, h, scale, dots, qs, q_bits, acc, m, l, pairs)
    qpos[:] = seq_len - 1


@njit(inline="always", **_JIT)
def _start_item(q, qo_indptr, seq, seq_len, head, row_begin, row_end, group, page_size, window,
                scale, dots, alibi_slopes, qs, q_bits, acc, m, l, qpos, slopes, pairs=False):
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


@njit(inline="always", **_JIT)
def _takes_fma_tiles(k_cache):
    """Whether a storage's FMA tiles apply: head_dim a multiple of 16."""
    return k_cache.shape[3] % bf16.LANES == 0


@njit(inline="always", **_JIT)
def _finish_row(acc_row, m_r, l_r, out_row, dots, amx_sums=False, pairs=False):
    """Write acc / l to out_row and return the row's log-sum-exp (-inf and zeros if nothing attended).

    dots: the accumulators are the vdpbf16ps value tiles', their dimensions in the order of
    :func:`bf16.value_dim`; amx_sums: the AMX value tiles' (:func:`_amx.acc_dim`); pairs: the
    bfloat16 FMA tiles' pair order (:func:`bf16.pair_dim`). Each is put back in order here, once
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
            d = bf16.value_dim(j, head_dim)
        else:
            d = bf16.pair_dim(j) if pairs else j
        out_row[d] = acc_row[j] * inv
    return m_r + math.log(l_r)


def _decode_kernel(kind):
    """The kernel of :func:`decode` for one ``kind`` (:func:`_kernel_kind`): the FMA tiles of
    one storage (float32, float16, bfloat16; Numba's loops where they do not apply), or the
    vdpbf16ps tiles (``bf16.PAIRED``).

    Each compiles only its own kind of tiles: a cold compile of decode took 27-31 s with the
    float32 and bfloat16 tiles in one kernel, 20-23 s per storage then (this VM, noisy), and a
    float32 cache never needs the bfloat16 kernel. Memory-bound speed was unchanged (S1/S2/S3,
    paired rounds: 0.99-1.02x the time).
    """
    fma = kind != bf16.PAIRED  # FMA tiles: the queries are scaled float32, the probabilities float32
    pair_kind = kind == "bfloat16" and bf16.PAIR_ORDER  # the tiles' rows in pair order (AVX2)

    @njit(parallel=True, **_JIT)
    def decode(q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale,
               window, soft_cap, alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks, num_threads):
        num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        num_q_heads = q.shape[1]
        group = num_q_heads // num_kv_heads
        chunk_pages = max(1, CHUNK_TOKENS // page_size)
        # float32 pages: the FMA tiles. Against Numba's loops, MHA read 2-10% faster from memory and
        # 25-45% from cache (head_dim 64/80/128, 8-32 heads); GQA, with each line prefetched twice,
        # 0-18% faster from memory and 10-50% from cache (kernels/_bf16_dot.py has the exceptions).
        tiles = _takes_fma_tiles(k_cache) if fma else True
        dots = not fma  # the vdpbf16ps tiles' rounded queries and probabilities
        pairs = pair_kind and tiles
        # Numba's loops ask for each line once (kernels/prefetch.py): no second block address for them.
        distances = (prefetch_blocks[0], prefetch_blocks[1] if tiles else 0)
        num_slots, next_slot = slot_indptr.shape[0] - 1, slots.new_counter()
        for _ in prange(min(num_slots, num_threads)):
            qs, acc, m, l, qpos, scores = _thread_scratch(
                num_q_heads, chunk_pages * page_size, head_dim)
            q_bits, packed = _dot_scratch(num_q_heads, chunk_pages * page_size, head_dim, dots)
            slot = slots.claim(next_slot)
            while slot < num_slots:
                for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
                    seq, page_begin, page_end, part = items[item]
                    seq_len = seq_lens[seq]
                    _start_decode_item(q, seq, seq_len, scale, dots, qs, q_bits, acc, m, l, qpos,
                                       pairs)
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
                                    _page_scores(qs, head * group, group, k_cache, page, head, kv_format,
                                                 num_tokens, scores, (p - first) * page_size, ahead)
                                elif fma:  # the queries are scaled already
                                    _DECODE_SCORES(kind, qs, head * group, group, k_cache, page, head,
                                                num_tokens, np.float32(1.0), scores,
                                                (p - first) * page_size, ahead, again)
                                else:
                                    _DECODE_SCORES(kind, q_bits, head * group, group, k_cache, page, head,
                                                num_tokens, scale, scores, (p - first) * page_size,
                                                ahead, again)
                        masked = window > 0 and key0 <= seq_len - 1 - window
                        _softmax_update(scores, 0, num_q_heads, num_cols, key0, qpos, masked, window,
                                        soft_cap, alibi_slopes, m, l, acc)
                        if dots:
                            bf16.pack_pairs(scores, 0, num_q_heads, num_cols, packed)
                        for p in range(first, last):
                            page = block_table[seq, p]
                            num_tokens = min(page_size, seq_len - p * page_size)
                            for head in range(num_kv_heads):
                                ahead, again = _blocks_ahead(
                                    k_cache, v_cache, block_table, seq, p, head, num_kv_heads, first, last,
                                    page_end, chunk_pages, True, distances)
                                if not tiles:
                                    _page_accumulate(scores, head * group, group, (p - first) * page_size,
                                                     v_cache, page, head, kv_format, num_tokens, acc, ahead)
                                elif fma:
                                    _DECODE_VALUES(kind, scores, head * group, group, (p - first) * page_size,
                                                    v_cache, page, head, num_tokens, acc, ahead, again)
                                else:
                                    _DECODE_VALUES(kind, packed, head * group, group, (p - first) * page_size,
                                                    v_cache, page, head, num_tokens, acc, ahead, again)
                    for h in range(num_q_heads):
                        if part < 0:
                            lse[seq, h] = _finish_row(acc[h], m[h], l[h], out[seq, h], dots,
                                                      pairs=pairs)
                        else:
                            part_lse[part, h] = _finish_row(acc[h], m[h], l[h], part_out[part, h],
                                                            dots, pairs=pairs)
                slot = slots.claim(next_slot)

    return decode


_DECODE = {kind: _decode_kernel(kind) for kind in _KINDS}


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
    bfloat16 pages may take the vdpbf16ps tiles (query and probabilities rounded to bfloat16;
    kernels/_bf16_dot.py), when the shape allows.
    """
    _DECODE[_kernel_kind(k_cache, kv_format, dot_products)](
        q, k_cache, v_cache, kv_format, block_table, seq_lens, items, slot_indptr, scale, window,
        soft_cap, alibi_slopes, out, lse, part_out, part_lse, prefetch_blocks, get_num_threads())


@njit(parallel=True, **_JIT)
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
    fma = kind != bf16.PAIRED
    pair_kind = kind == "bfloat16" and bf16.PAIR_ORDER

    @njit(parallel=True, **_JIT)
    def prefill(q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr,
                scale, window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, num_threads):
        num_kv_heads, page_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // num_kv_heads
        max_rows = QUERY_BLOCK * group
        chunk_pages = max(1, CHUNK_TOKENS // page_size)
        # float32 pages: the FMA score and value tiles (compute-bound here: 1.4-1.7x faster than
        # Numba's loops, kernels/_bf16_dot.py), as in decode. The queries are scaled already.
        tiles = _takes_fma_tiles(k_cache) if fma else True
        dots = not fma
        pairs = pair_kind and tiles
        num_slots, next_slot = slot_indptr.shape[0] - 1, slots.new_counter()
        for _ in prange(min(num_slots, num_threads)):
            qs, acc, m, l, qpos, scores = _thread_scratch(
                max_rows, chunk_pages * page_size, head_dim)
            q_bits, packed = _dot_scratch(max_rows, chunk_pages * page_size, head_dim, dots)
            slopes = np.empty(max_rows if alibi_slopes.shape[0] > 0 else 0, np.float32)
            slot = slots.claim(next_slot)
            while slot < num_slots:
                for item in range(slot_indptr[slot], slot_indptr[slot + 1]):
                    seq, head, row_begin, row_end = items[item]
                    seq_len = seq_lens[seq]
                    num_rows, low, high, page_begin, page_end = _start_item(
                        q, qo_indptr, seq, seq_len, head, row_begin, row_end, group, page_size, window,
                        scale, dots, alibi_slopes, qs, q_bits, acc, m, l, qpos, slopes, pairs)
                    for first in range(page_begin, page_end, chunk_pages):
                        last = min(first + chunk_pages, page_end)
                        key0 = first * page_size
                        num_cols = min((last - first) * page_size, seq_len - key0)
                        for p in range(first, last):
                            ahead = _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                   page_end, chunk_pages, False, prefetch_blocks)
                            num_tokens = min(page_size, seq_len - p * page_size)
                            if not tiles:
                                _page_scores(qs, 0, num_rows, k_cache, block_table[seq, p], head, kv_format,
                                             num_tokens, scores, (p - first) * page_size, ahead)
                            elif fma:
                                _PREFILL_SCORES(kind, qs, 0, num_rows, k_cache, block_table[seq, p], head,
                                            num_tokens, np.float32(1.0), scores, (p - first) * page_size,
                                            ahead, 0)
                            else:
                                _PREFILL_SCORES(kind, q_bits, 0, num_rows, k_cache, block_table[seq, p],
                                            head, num_tokens, scale, scores,
                                            (p - first) * page_size, ahead, 0)
                        masked = key0 + num_cols - 1 > low or (window > 0 and key0 <= high - window)
                        _softmax_update(scores, 0, num_rows, num_cols, key0, qpos, masked, window, soft_cap,
                                        slopes, m, l, acc)
                        if dots:
                            bf16.pack_pairs(scores, 0, num_rows, num_cols, packed)
                        for p in range(first, last):
                            ahead = _prefill_ahead(k_cache, v_cache, block_table, seq, p, head, first, last,
                                                   page_end, chunk_pages, True, prefetch_blocks)
                            num_tokens = min(page_size, seq_len - p * page_size)
                            if not tiles:
                                _page_accumulate(scores, 0, num_rows, (p - first) * page_size, v_cache,
                                                 block_table[seq, p], head, kv_format, num_tokens, acc, ahead)
                            elif fma:
                                _PREFILL_VALUES(kind, scores, 0, num_rows, (p - first) * page_size, v_cache,
                                                block_table[seq, p], head, num_tokens, acc, ahead, 0)
                            else:
                                _PREFILL_VALUES(kind, packed, 0, num_rows, (p - first) * page_size,
                                                v_cache, block_table[seq, p], head, num_tokens,
                                                acc, ahead, 0)
                    for i in range(row_end - row_begin):
                        for g in range(group):
                            r = i * group + g
                            lse[row_begin + i, head * group + g] = _finish_row(
                                acc[r], m[r], l[r], out[row_begin + i, head * group + g], dots,
                                pairs=pairs)
                slot = slots.claim(next_slot)

    return prefill


_PREFILL = {kind: _prefill_kernel(kind) for kind in _KINDS}


def prefill(q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr,
            scale, window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, *, dot_products):
    """Causal attention of each sequence's new tokens over its whole paged context.

    q, out : float32 [num_tokens, num_q_heads, head_dim]; lse : float32 [num_tokens, num_q_heads].
    Sequence s owns q rows qo_indptr[s]:qo_indptr[s+1], the last of its seq_lens[s] positions.
    items : int32 [num_items, 4] = (seq, kv_head, row_begin, row_end), at most QUERY_BLOCK rows.
    prefetch_blocks : int, the far distance of :func:`decode` (an item's blocks are its head's
    pages); the tiles are not asked again nearer: that made prefill 1-4% slower (compute-bound).
    dot_products : bool, as in :func:`decode`.
    """
    _PREFILL[_kernel_kind(k_cache, kv_format, dot_products)](
        q, k_cache, v_cache, kv_format, block_table, seq_lens, qo_indptr, items, slot_indptr, scale,
        window, soft_cap, alibi_slopes, out, lse, prefetch_blocks, get_num_threads())
