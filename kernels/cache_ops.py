"""Kernels that move KV data: write new tokens into pages, copy pages (copy-on-write), gather pages
into a dense array. They work on any storage dtype (float32, or uint16 bit patterns of float16 and
bfloat16) because they only move bits."""

from typing import Any

import numpy as np
from numba import njit, prange

_JIT: dict[str, Any] = dict(cache=True, error_model="numpy", nogil=True)


@njit(parallel=True, **_JIT)
def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Store token i's keys and values at slot ``slot_mapping[i]`` (page * page_size + offset).

    k, v : [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache : [num_pages, num_kv_heads,
    page_size, head_dim], same dtype; slot_mapping : int64 [num_tokens], negative = skip.
    """
    page_size = k_cache.shape[2]
    for i in prange(slot_mapping.shape[0]):
        slot = slot_mapping[i]
        if slot < 0:
            continue
        page, offset = slot // page_size, slot % page_size
        for h in range(k_cache.shape[1]):
            k_cache[page, h, offset, :] = k[i, h, :]
            v_cache[page, h, offset, :] = v[i, h, :]


@njit(parallel=True, **_JIT)
def copy_pages(k_cache, v_cache, src, dst):
    """Copy every head of page ``src[i]`` to page ``dst[i]`` (dst distinct and disjoint from src)."""
    for i in prange(src.shape[0]):
        k_cache[dst[i]] = k_cache[src[i]]
        v_cache[dst[i]] = v_cache[src[i]]


@njit(parallel=True, **_JIT)
def gather_kv(k_cache, v_cache, block_table, kv_indptr, k_out, v_out):
    """Copy each sequence's paged K/V into dense rows ``kv_indptr[s]:kv_indptr[s+1]`` of k_out/v_out.

    k_out, v_out : [total_tokens, num_kv_heads, head_dim].
    """
    page_size = k_cache.shape[2]
    for s in prange(kv_indptr.shape[0] - 1):
        for pos in range(kv_indptr[s + 1] - kv_indptr[s]):
            page, offset = block_table[s, pos // page_size], pos % page_size
            for h in range(k_cache.shape[1]):
                k_out[kv_indptr[s] + pos, h, :] = k_cache[page, h, offset, :]
                v_out[kv_indptr[s] + pos, h, :] = v_cache[page, h, offset, :]


@njit(parallel=True, cache=True, error_model="numpy", nogil=True)
def merge_states(o_a, lse_a, o_b, lse_b, o_out, lse_out):
    """Merge two partial attention states by log-sum-exp (float32).

    o_* : [num_rows, num_heads, head_dim]; lse_* : [num_rows, num_heads] (natural log).
    """
    for i in prange(o_a.shape[0]):
        for h in range(o_a.shape[1]):
            a, b = lse_a[i, h], lse_b[i, h]
            top = max(a, b)
            if top == -np.inf:
                o_out[i, h, :] = 0.0
                lse_out[i, h] = -np.inf
                continue
            wa, wb = np.exp(a - top), np.exp(b - top)
            total = wa + wb
            for d in range(o_a.shape[2]):
                o_out[i, h, d] = (wa * o_a[i, h, d] + wb * o_b[i, h, d]) / total
            lse_out[i, h] = top + np.log(total)


@njit(**_JIT)
def _copy_row(src, dst):
    """dst[:] = src[:] for 1-D contiguous rows. An explicit loop: LLVM makes it a vectorised copy,
    where Numba's slice assignment of 16-bit elements ran at a third of the speed."""
    for i in range(src.shape[0]):
        dst[i] = src[i]


@njit(parallel=True, **_JIT)
def copy_across(src, dst, src_pages, dst_pages):
    """Copy pages between two pools: ``dst[:, dst_pages[i]] = src[:, src_pages[i]]`` (swapping).

    src : [planes, src_num_pages, page_elems]; dst : [planes, dst_num_pages, page_elems], same dtype
    (planes = num_layers * 2: every layer's K and V). Work items are (page, plane) pairs.
    """
    planes = src.shape[0]
    for w in prange(src_pages.shape[0] * planes):
        page, plane = w // planes, w % planes
        _copy_row(src[plane, src_pages[page]], dst[plane, dst_pages[page]])


@njit(**_JIT)
def copy_across_serial(src, dst, src_pages, dst_pages):
    """:func:`copy_across` on one core, for a background thread (the GIL is released meanwhile)."""
    for page in range(src_pages.shape[0]):
        for plane in range(src.shape[0]):
            _copy_row(src[plane, src_pages[page]], dst[plane, dst_pages[page]])
