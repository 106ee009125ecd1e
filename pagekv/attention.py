"""Paged attention and KV-cache operations: the public, validating face of ``pagekv.kernels``.

Every function here checks shapes, dtypes, contiguity and page ids and raises "expected X, got Y"
errors, then calls a Numba kernel that trusts its input. Caches use the layout of docs/layout.md:
``k_cache``, ``v_cache`` each ``[num_pages, num_kv_heads, page_size, head_dim]`` (one layer),
C-contiguous, float32, float16, bfloat16 or float8_e4m3fn (numpy, ``ml_dtypes.bfloat16`` and
``ml_dtypes.float8_e4m3fn``, uint16 bfloat16 bits, uint8 float8 bits, or torch CPU tensors — never
copied). Accumulation is float32; outputs have the query's dtype (float32, float16 or bfloat16).
The log-sum-exp values (``return_lse``, ``merge_states``) use the natural logarithm.
"""

import math
import numbers
from dataclasses import dataclass, field

import numba
import numpy as np

from pagekv import _arrays
from pagekv.errors import InvalidPageError
from pagekv.kernels import _warm
from pagekv.kernels import amx_attention as _amx_attention
from pagekv.kernels import attention as _attention
from pagekv.kernels import cache_ops as _cache_ops
from pagekv.kernels import convert as _convert
from pagekv.kernels import plan as _plan
from pagekv.kernels import slots as _slots
from pagekv.kernels import threads as _threads
from pagekv.kernels import validate as _validate
from pagekv.kernels._tile_ir import ACCUMULATORS, HAS_AVX512_BF16

__all__ = [
    "DecodePlan",
    "plan_decode",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv",
    "copy_pages",
    "gather_kv",
    "merge_states",
]

MIN_SPLIT_TOKENS = 256  # a split piece of a long sequence covers at least this many tokens
# How far ahead of its reads a kernel streams K/V into L2 with `prefetch=True` (docs/performance.md:
# prefetch).
# It follows how fast the tiles compute, so it is set by their register budget. AVX-512's tiles: 64
# KiB, as they compute fast enough that 16 KiB arrived late (AMD EPYC Zen 4, S1/S3 bfloat16, page 16:
# 73-76% of the roof at 16 KiB, 79-81% at 64 KiB, two interleaved runs; float32 alike). AVX2's
# tiles: 16 KiB. On an AMD EPYC Zen 3 (AVX2) decode took 0.88-0.98x the time it took at 64 KiB at
# S1/S2/S3, both dtypes (paged, three runs of 25 alternating rounds; consecutive 0.84-0.94x), and
# 24-32 KiB fell between; chunked prefill measured alike (0.99-1.03x).
PREFETCH_BYTES = (64 if ACCUMULATORS >= 16 else 16) * 1024
# Decode's tiles ask for each line again this fraction of the distance ahead: a prefetch is a hint
# the CPU may drop (kernels/prefetch.py). An eighth (8 KiB of 64) gained the most at S1/S2/S3
# bfloat16, a half or a quarter less. Not for blocks under PREFETCH_AGAIN_MIN_BLOCK bytes: at page
# size 2 (256-byte blocks) S3 bfloat16 decode took 1.15x the time with it (the block addresses
# cost more than the reads they speed up), while 512-byte blocks still gained (S1 page 2: 0.90x).
PREFETCH_AGAIN_FRACTION = 8
PREFETCH_AGAIN_MIN_BLOCK = 512
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
# fast_bf16 multiplies in bfloat16 (bfloat16 and float8 pages) only where the CPU has bfloat16
# products (AVX512-BF16, which every CPU with AMX-BF16 has too). Elsewhere the float32 FMA tiles over rows widened as they are
# loaded are exact and faster than emulated bfloat16 products (AMD EPYC Zen 3, AVX2: with the
# tiles sized to its registers, S1 bfloat16 decode 42% -> 58% of the roof; docs/performance.md).
# The tests set it to run the vdpbf16ps tiles' portable form on any CPU.
BF16_PRODUCTS = HAS_AVX512_BF16


# ----------------------------------------------------------------------------------- conversions
def _to_float32(array, kind):
    """float32 values of a storage array (a copy unless it is float32 already; same shape)."""
    if kind == "float32":
        return array
    out = np.empty(array.shape, np.float32)
    bits = np.ascontiguousarray(array).reshape(-1)
    if kind == "float8_e4m3fn":
        _convert.widen_e4m3(bits, out.reshape(-1))
    else:
        _convert.widen(bits, _arrays.KV_FORMAT[kind], out.reshape(-1))
    return out


def _from_float32(values, kind, out):
    """Store float32 ``values`` into the storage array ``out`` of ``kind`` (round to nearest even;
    float8 E4M3 saturates at +-448, kernels/convert.py).

    out : C-contiguous, ``values``'s shape.
    """
    if kind == "float32":
        out[...] = values
        return
    values = np.ascontiguousarray(values, np.float32).reshape(-1)
    if kind == "float8_e4m3fn":
        _convert.narrow_e4m3(values, out.reshape(-1))
    else:
        _convert.narrow(values, _arrays.KV_FORMAT[kind], out.reshape(-1))


# ---------------------------------------------------------------------------------------- checks
def _caches(k_cache, v_cache, *, written=False):
    """Storage views of the caches, checked; ``written``: the call stores into them."""
    k, kind = _arrays.float_storage(k_cache, "k_cache", float8=True)
    v, v_kind = _arrays.float_storage(v_cache, "v_cache", float8=True)
    if k.ndim != 4:
        raise ValueError("expected k_cache of shape [num_pages, num_kv_heads, page_size, head_dim], "
                         f"got {k.ndim}-D shape {k.shape}")
    if 0 in k.shape[1:]:
        raise ValueError("expected k_cache with num_kv_heads, page_size and head_dim >= 1, "
                         f"got shape {k.shape}")
    if v.shape != k.shape or v_kind != kind:
        raise ValueError(f"expected v_cache like k_cache ({kind} {k.shape}), got {v_kind} {v.shape}")
    for name, array in (("k_cache", k), ("v_cache", v)):
        if not array.flags.c_contiguous:
            raise ValueError(f"expected a C-contiguous {name}, got strides {array.strides}")
        if written and not array.flags.writeable:
            raise ValueError(f"expected a writeable {name}, got a read-only array")
    return k, v, kind


def _real(value, name) -> float:
    """A real-number argument as a float (a bool or a string is a mistake, not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"expected {name} a real number, got {value!r}")
    return float(value)


def _positive_int(value, name, *, optional=False) -> int:
    """An integer argument >= 1 (``optional``: None gives 0)."""
    if value is None and optional:
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"expected {name} {'None or ' if optional else ''}an integer >= 1, "
                         f"got {value!r}")
    return int(value)


def _window(sliding_window) -> int:
    """A sliding window as an int (0: none). One wider than any int32 length changes nothing, so
    it is narrowed to that width rather than overflowing the kernels' integers."""
    return min(_positive_int(sliding_window, "sliding_window", optional=True), _INT32_MAX)


def _flag(value, name) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"expected {name} a bool, got {value!r}")
    return bool(value)


def _bf16_products(fast_bf16):
    """Whether bfloat16 and float8 pages may multiply in bfloat16 (``dot_products`` of the kernels)."""
    return _flag(fast_bf16, "fast_bf16") and BF16_PRODUCTS


def _scalar_options(head_dim, scale, sliding_window, logits_soft_cap, alibi_slopes, num_q_heads):
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _real(scale, "scale")
    if not abs(scale) <= _FLOAT32_MAX:  # the kernels take float32: 1e40 would become inf
        raise ValueError(f"expected a finite scale within float32's range, got {scale}")
    window = _window(sliding_window)
    cap = 0.0 if logits_soft_cap is None else _real(logits_soft_cap, "logits_soft_cap")
    if logits_soft_cap is not None and not 0.0 < cap <= _FLOAT32_MAX:
        raise ValueError(f"expected logits_soft_cap None or > 0 within float32's range, "
                         f"got {logits_soft_cap!r}")
    if alibi_slopes is None:
        slopes = np.empty(0, np.float32)
    else:
        with np.errstate(over="ignore"):  # a slope past float32's range becomes inf: refused below
            slopes = _float32_values(alibi_slopes, "alibi_slopes")
        if slopes.shape != (num_q_heads,):
            raise ValueError(f"expected alibi_slopes of shape ({num_q_heads},), got {slopes.shape}")
        bad = np.flatnonzero(~np.isfinite(slopes))  # a NaN slope would make every output NaN
        if bad.size:
            raise ValueError(f"expected finite alibi_slopes within float32's range, got "
                             f"{slopes[bad[0]]} (as float32) at index {bad[0]}")
    return np.float32(scale), window, np.float32(cap), slopes


def _kv_scale(value, name) -> float:
    """A per-tensor scale of a cache's numbers (the cache holds x / scale); None gives 1."""
    if value is None:
        return 1.0
    scale = _real(value, name)
    if not 0.0 < scale <= _FLOAT32_MAX:  # NaN fails too
        raise ValueError(f"expected {name} None or a number > 0 within float32's range, got {value!r}")
    return scale


def _scaled_scores(scale, k_scale):
    """The scores' factor for keys stored divided by k_scale (float32, checked finite)."""
    scaled = float(scale) * k_scale
    if not abs(scaled) <= _FLOAT32_MAX:
        raise ValueError(f"expected scale * k_scale within float32's range, got {scaled}")
    return np.float32(scaled)


def _page_tables(block_table, seq_lens, num_seqs, page_size, num_pages):
    table = _arrays.int_array(block_table, "block_table", 2)
    lens = _arrays.int_array(seq_lens, "seq_lens", 1)
    if table.shape[0] != num_seqs or lens.shape[0] != num_seqs:
        raise ValueError(f"expected block_table and seq_lens for {num_seqs} sequences, "
                         f"got {table.shape[0]} and {lens.shape[0]}")
    problem, s, p = _validate.first_bad_entry(table, lens, page_size, num_pages)
    if problem == _validate.NEGATIVE_LENGTH:
        raise ValueError(f"expected seq_lens >= 0, got {lens[s]} for sequence {s}")
    if problem == _validate.PAST_CAPACITY:
        raise ValueError(f"expected seq_lens <= {table.shape[1] * page_size} (block_table holds "
                         f"{table.shape[1]} pages of {page_size}), got {lens[s]} for sequence {s}")
    if problem == _validate.BAD_PAGE:
        raise InvalidPageError(f"expected page ids in [0, {num_pages}), got {table[s, p]} "
                               f"at block_table[{s}, {p}]")
    return table, lens


def _query(q, name, num_kv_heads, head_dim):
    array, kind = _arrays.float_storage(q, name)
    if array.ndim != 3:
        raise ValueError(f"expected {name} of shape [num_tokens, num_q_heads, head_dim], "
                         f"got {array.ndim}-D shape {array.shape}")
    if array.shape[2] != head_dim:
        raise ValueError(f"expected {name} head_dim {head_dim} (the cache's), got {array.shape[2]}")
    if array.shape[1] % num_kv_heads or array.shape[1] == 0:  # 0 heads: groups of 0, no sense
        raise ValueError(f"expected num_q_heads a positive multiple of num_kv_heads {num_kv_heads}, "
                         f"got {array.shape[1]}")
    return np.ascontiguousarray(_to_float32(array, kind), dtype=np.float32), kind


def _inputs(q, k_cache, v_cache, scale, sliding_window, logits_soft_cap, alibi_slopes, k_scale,
            v_scale):
    """Checked caches, float32 queries and scalar options shared by decode and prefill: (scores'
    scale with k_scale in it, window, soft cap, ALiBi slopes, v_scale)."""
    k, v, kind = _caches(k_cache, v_cache)
    q32, q_kind = _query(q, "q", k.shape[1], k.shape[3])
    scale, window, cap, slopes = _scalar_options(k.shape[3], scale, sliding_window, logits_soft_cap,
                                                 alibi_slopes, q32.shape[1])
    options = (_scaled_scores(scale, _kv_scale(k_scale, "k_scale")), window, cap, slopes,
               _kv_scale(v_scale, "v_scale"))
    return k, v, kind, q32, q_kind, options


def _finish(buffer, v_scale, q_kind, storage):
    """The kernel's float32 output times v_scale, into the caller's storage (rounded to q's dtype)."""
    if v_scale != 1.0:
        buffer *= np.float32(v_scale)
    if buffer is not storage:
        _from_float32(buffer, q_kind, storage)


def _prefetch_blocks(prefetch, cache) -> tuple[int, int]:
    """Head blocks (one page of one KV head) of ``cache`` that ``prefetch`` bytes ahead spans, and
    that the second, nearer request spans (PREFETCH_AGAIN_FRACTION of it; 0 unless nearer, or
    when a block is smaller than PREFETCH_AGAIN_MIN_BLOCK bytes).

    True means PREFETCH_BYTES, False or 0 none; a distance rounds up to whole blocks.
    """
    if prefetch is True:  # the default, first: this runs on every call
        distance = PREFETCH_BYTES
    elif isinstance(prefetch, (bool, np.bool_)):
        distance = PREFETCH_BYTES * bool(prefetch)
    elif isinstance(prefetch, (int, np.integer)) and prefetch >= 0:
        distance = min(int(prefetch), 2**62)  # further than any visit order, within int64
    else:
        raise ValueError(f"expected prefetch a bool or a number of bytes >= 0, got {prefetch!r}")
    block_bytes = cache.shape[2] * cache.shape[3] * cache.itemsize  # not strides: 0 in an empty cache
    ahead = -(-distance // block_bytes)
    again = -(-distance // PREFETCH_AGAIN_FRACTION // block_bytes)
    return ahead, again if again < ahead and block_bytes >= PREFETCH_AGAIN_MIN_BLOCK else 0


def _output(q, kind, shape, out):
    """The caller's out (checked), or a new array like q; plus a float32 buffer the kernel writes."""
    if out is None:
        result, storage = _arrays.new_like(q, kind, shape)
    else:
        storage, out_kind = _arrays.float_storage(out, "out")
        if storage.shape != shape or out_kind != kind:
            raise ValueError(f"expected out {kind} {shape}, got {out_kind} {storage.shape}")
        if not storage.flags.c_contiguous or not storage.flags.writeable:
            raise ValueError("expected a C-contiguous, writeable out")
        result = out
    buffer = storage if kind == "float32" else np.empty(shape, np.float32)
    return result, storage, buffer


# ---------------------------------------------------------------------------------------- plans
@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The work split of one decode step, reusable by every layer of that step.

    Attributes
    ----------
    seq_lens : int32 [num_seqs]
        The lengths the plan was made for (checked on use).
    items : int32 [num_items, 4]
        (seq, page_begin, page_end, part) work items, all KV heads each.
    slot_indptr : int32 [num_slots + 1]
        Items of slot i: ``items[slot_indptr[i]:slot_indptr[i + 1]]``; the threads claim the slots,
        of equal cost, one by one as they come free.
    split_seqs : int32 [num_split, 3]
        (seq, part_begin, part_end) of sequences split across slots.
    num_parts : int
    page_size, window : int
    """

    seq_lens: np.ndarray
    items: np.ndarray
    slot_indptr: np.ndarray
    split_seqs: np.ndarray
    num_parts: int
    page_size: int
    window: int
    # Set only by _new_plan: the kernels trust a plan's work items, so a DecodePlan built by hand
    # (or by dataclasses.replace, which runs __init__) is refused rather than read.
    _made_by_plan_decode: bool = field(default=False, init=False, repr=False)


def _new_plan(lens, page_size, window, threads):
    """A DecodePlan for checked int32 ``lens`` (>= 0), page_size >= 1, window (0: none) and
    thread count."""
    num_slots = threads * _slots.SLOTS_PER_THREAD  # claimed by the threads as they come free
    min_chunk = max(1, MIN_SPLIT_TOKENS // page_size)
    items, slot_indptr, split_seqs, num_parts = _plan.plan_decode(
        lens, page_size, window, num_slots, min_chunk)
    plan = DecodePlan(lens.copy(), items, slot_indptr, split_seqs, int(num_parts), int(page_size),
                      window)
    object.__setattr__(plan, "_made_by_plan_decode", True)  # frozen: set past __init__
    return plan


def plan_decode(seq_lens, *, page_size, sliding_window=None, num_threads=None):
    """Balance a decode step's work across threads; pass the result as ``plan=`` to every layer.

    Parameters
    ----------
    seq_lens : int32 [num_seqs]
    page_size : int
    sliding_window : int, optional
    num_threads : int, optional
        The threads that will run it (defaults to Numba's current thread count): the plan cuts
        the work into ``kernels.slots.SLOTS_PER_THREAD`` slots of equal cost per thread.

    Returns
    -------
    DecodePlan
    """
    lens = _arrays.int_array(seq_lens, "seq_lens", 1)
    if lens.size and lens.min() < 0:
        s = int(lens.argmin())
        raise ValueError(f"expected seq_lens >= 0, got {lens[s]} for sequence {s}")
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"expected page_size a positive integer, got {page_size!r}")
    window = _window(sliding_window)
    threads = numba.get_num_threads() if num_threads is None else _positive_int(num_threads, "num_threads")
    return _new_plan(lens, page_size, window, threads)


# ---------------------------------------------------------------------------------------- attention
def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, out=None,
                           sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                           return_lse=False, plan=None, prefetch=True, fast_bf16=True, k_scale=None,
                           v_scale=None):
    """Attention of one new query token per sequence over its paged KV cache.

    Parameters
    ----------
    q : float [num_seqs, num_q_heads, head_dim]
        ``num_q_heads`` a multiple of ``num_kv_heads`` (GQA/MQA: query head i reads KV head
        ``i // (num_q_heads // num_kv_heads)``).
    k_cache, v_cache : float [num_pages, num_kv_heads, page_size, head_dim]
        float32, float16, bfloat16 or float8_e4m3fn (each number widened exactly to float32 as
        it is read).
    block_table : int32 [num_seqs, max_pages]
        Physical page of each logical page; entries past a sequence's length are ignored.
    seq_lens : int32 [num_seqs]
        Tokens of each sequence in the cache, including the new token's own K/V.
    scale : float, optional
        Defaults to ``1 / sqrt(head_dim)``.
    out : float [num_seqs, num_q_heads, head_dim], optional
        Written in place (q's dtype).
    sliding_window : int, optional
        Each query sees only the last ``sliding_window`` keys (itself included).
    logits_soft_cap : float, optional
        Scores become ``cap * tanh(score / cap)`` (after scaling).
    alibi_slopes : float [num_q_heads], optional
        float32 or float64 (or a list); adds ``slope * (key_pos - query_pos)`` to each score.
    k_scale, v_scale : float, optional
        Per-tensor scales of a cache that holds keys / k_scale and values / v_scale, as
        :func:`write_kv` stores them given the same scales (the convention of vLLM's and
        FlashInfer's float8 caches, whose numbers reach only +-448): the scores take
        ``scale * k_scale`` and the outputs are multiplied by v_scale in float32, before they are
        rounded to q's dtype. None: 1.
    return_lse : bool
        Also return the log-sum-exp of each row's scores (natural log).
    plan : DecodePlan, optional
        From :func:`plan_decode` for these ``seq_lens``; made here when omitted.
    prefetch : bool or int
        Stream the K/V blocks the kernel reads next into L2 while it computes (``True``:
        PREFETCH_BYTES ahead of the reads; an int: that many bytes ahead, rounded up to whole
        blocks of one page and KV head; ``False`` or 0: off). The tiles ask for each line again
        PREFETCH_AGAIN_FRACTION of that distance ahead. On by default: it took the decode
        benchmarks from ~50% to ~85% of the streaming-read bandwidth (docs/performance.md).
        Results do not depend on it.
    fast_bf16 : bool
        bfloat16 and float8 caches with head_dim a multiple of 16 and an even page_size, on CPUs
        with AVX512-BF16: multiply in bfloat16 (``vdpbf16ps``; float8 numbers are bfloat16
        numbers, turned into them exactly as they are loaded). The query and the softmax
        probabilities are rounded to bfloat16 once — a bfloat16 query stays exact — and every sum
        is float32, as FlashAttention does on GPUs: outputs move by about one bfloat16 rounding
        (<= 3e-3 relative, measured) and decode runs ~1.6x faster from cache over bfloat16 pages,
        1.6-1.9x over float8 pages (docs/performance.md). ``False``: float32 products, the query
        and probabilities unrounded. CPUs without AVX512-BF16 (AMD before Zen 4, Intel before
        Cooper Lake) have no bfloat16 products: there these pages always take the float32
        products, the faster path on them.
        On CPUs with AMX-BF16 (Intel Xeon since Sapphire Rapids, Linux), GQA groups of 2-16
        query heads (4-16 with head_dim over 128), head_dim a multiple of 32 and a page size
        that is a multiple of 16 multiply by AMX tiles instead, rounding the same inputs (S1:
        1.1x the speed from memory, 1.8x from L2; environment variable ``PAGEKV_AMX=0``: not
        taken).

    Returns
    -------
    out : [num_seqs, num_q_heads, head_dim], q's dtype (and kind: numpy or torch)
    lse : float32 [num_seqs, num_q_heads], only with ``return_lse``
        -inf (and a zero output row) for a sequence with no visible key.

    Examples
    --------
    >>> import numpy as np
    >>> from pagekv.attention import paged_decode_attention
    >>> k = np.random.default_rng(0).standard_normal((4, 1, 16, 64), dtype=np.float32)
    >>> q = np.ones((1, 2, 64), np.float32)
    >>> out = paged_decode_attention(q, k, k, np.array([[3, 1]], np.int32), np.array([20], np.int32))
    >>> out.shape
    (1, 2, 64)
    """
    k, v, kind, q32, q_kind, (scale, window, cap, slopes, v_scale) = _inputs(
        q, k_cache, v_cache, scale, sliding_window, logits_soft_cap, alibi_slopes, k_scale, v_scale)
    num_pages, num_kv_heads, page_size, head_dim = k.shape
    num_seqs, num_q_heads = q32.shape[:2]
    table, lens = _page_tables(block_table, seq_lens, num_seqs, page_size, num_pages)
    return_lse = _flag(return_lse, "return_lse")
    if plan is None:  # lens and window are checked already
        plan = _new_plan(lens, page_size, window, numba.get_num_threads())
    elif not isinstance(plan, DecodePlan) or not plan._made_by_plan_decode:
        raise TypeError(f"expected plan None or a DecodePlan from plan_decode, got "
                        f"{'one made elsewhere' if isinstance(plan, DecodePlan) else type(plan).__name__}")
    elif ((plan.page_size, plan.window) != (page_size, window)
          or not np.array_equal(plan.seq_lens, lens)):
        raise ValueError("expected a plan made for these seq_lens, page_size and sliding_window, "
                         "got one made for others")
    result, storage, buffer = _output(q, q_kind, q32.shape, out)
    lse = np.empty((num_seqs, num_q_heads), np.float32)
    part_out = np.empty((plan.num_parts, num_q_heads, head_dim), np.float32)
    part_lse = np.empty((plan.num_parts, num_q_heads), np.float32)
    _threads.start()
    kv_format, dot_products = _arrays.KV_FORMAT[kind], _bf16_products(fast_bf16)
    if _amx_attention.applies_to_decode(k, kv_format, dot_products, num_q_heads // num_kv_heads):
        _warm.announce_compile(_amx_attention.decode, "bfloat16 AMX", "decode")
        _amx_attention.decode(q32, k, v, table, lens, plan.items, plan.slot_indptr, scale, window,
                              cap, slopes, buffer, lse, part_out, part_lse, _prefetch_blocks(prefetch, k))
    else:
        _attention.decode(q32, k, v, kv_format, table, lens, plan.items, plan.slot_indptr, scale,
                          window, cap, slopes, buffer, lse, part_out, part_lse,
                          _prefetch_blocks(prefetch, k), dot_products=dot_products)
    if len(plan.split_seqs):
        _attention.merge_parts(part_out, part_lse, plan.split_seqs, buffer, lse)
    _finish(buffer, v_scale, q_kind, storage)
    return (result, lse) if return_lse else result


def paged_prefill_attention(q, k_cache, v_cache, block_table, seq_lens, qo_indptr, *, scale=None,
                            out=None, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                            return_lse=False, prefetch=True, fast_bf16=True, k_scale=None,
                            v_scale=None):
    """Causal attention of each sequence's new tokens over its whole paged context.

    Sequence ``s`` brings query rows ``q[qo_indptr[s]:qo_indptr[s+1]]``: its last ``q_len`` tokens,
    whose K/V are already in the cache (``seq_lens[s]`` counts them). Each attends to every cached
    token up to and including its own position — a cached prefix (prefix hit, chunked prefill) and
    the new tokens causally.

    Parameters
    ----------
    q : float [num_tokens, num_q_heads, head_dim]
    k_cache, v_cache : float [num_pages, num_kv_heads, page_size, head_dim]
    block_table : int32 [num_seqs, max_pages]
    seq_lens : int32 [num_seqs]
        Each ``>= qo_indptr[s+1] - qo_indptr[s]``.
    qo_indptr : int32 [num_seqs + 1]
        Nondecreasing, from 0 to ``num_tokens``.
    scale, out, sliding_window, logits_soft_cap, alibi_slopes, return_lse, prefetch
        As in :func:`paged_decode_attention`.
    fast_bf16, k_scale, v_scale
        As in :func:`paged_decode_attention`. On CPUs with AMX-BF16 (Intel Xeon since Sapphire
        Rapids, Linux), ``fast_bf16`` over a bfloat16 cache with head_dim a multiple of 32 and a
        page size that is a multiple of 16 multiplies by AMX tiles, rounding the same inputs
        (3.1-3.2x the speed measured at S1; environment variable ``PAGEKV_AMX=0``: not taken).

    Returns
    -------
    out : [num_tokens, num_q_heads, head_dim], q's dtype
    lse : float32 [num_tokens, num_q_heads], only with ``return_lse``
    """
    k, v, kind, q32, q_kind, (scale, window, cap, slopes, v_scale) = _inputs(
        q, k_cache, v_cache, scale, sliding_window, logits_soft_cap, alibi_slopes, k_scale, v_scale)
    num_pages, num_kv_heads, page_size, head_dim = k.shape
    num_tokens, num_q_heads = q32.shape[:2]
    indptr = _arrays.int_array(qo_indptr, "qo_indptr", 1)
    num_seqs = indptr.shape[0] - 1
    if num_seqs < 0 or indptr[0] != 0 or indptr[-1] != num_tokens or np.any(np.diff(indptr) < 0):
        raise ValueError(f"expected qo_indptr nondecreasing from 0 to {num_tokens} (q's tokens), "
                         f"got {indptr.tolist() if indptr.size <= 8 else indptr}")
    table, lens = _page_tables(block_table, seq_lens, num_seqs, page_size, num_pages)
    return_lse = _flag(return_lse, "return_lse")
    q_lens = np.diff(indptr)
    if np.any(q_lens > lens):
        s = int(np.argmax(q_lens > lens))
        raise ValueError(f"expected seq_lens[{s}] >= its {q_lens[s]} query tokens, got {lens[s]}")
    kv_format, dot_products = _arrays.KV_FORMAT[kind], _bf16_products(fast_bf16)
    amx = _amx_attention.applies(k, kv_format, dot_products)  # CPUs with AMX: kernels/_amx.py
    num_slots = numba.get_num_threads() * _slots.SLOTS_PER_THREAD
    if amx:
        block = _amx_attention.item_tokens(num_tokens, num_q_heads // num_kv_heads, num_kv_heads,
                                           num_slots)
    else:
        block = _attention.query_tokens(num_q_heads // num_kv_heads)
    items, slot_indptr = _plan.plan_prefill(lens, indptr, page_size, num_kv_heads, window, num_slots,
                                            block)
    result, storage, buffer = _output(q, q_kind, q32.shape, out)
    lse = np.empty((num_tokens, num_q_heads), np.float32)
    _threads.start()
    if amx:
        _warm.announce_compile(_amx_attention.prefill, "bfloat16 AMX", "prefill")
        _amx_attention.prefill(q32, k, v, table, lens, indptr, items, slot_indptr, scale, window, cap,
                               slopes, buffer, lse, _prefetch_blocks(prefetch, k)[0])
    else:
        _attention.prefill(q32, k, v, kv_format, table, lens, indptr, items, slot_indptr, scale,
                           window, cap, slopes, buffer, lse, _prefetch_blocks(prefetch, k)[0],
                           dot_products=dot_products)
    _finish(buffer, v_scale, q_kind, storage)
    return (result, lse) if return_lse else result


# ---------------------------------------------------------------------------------------- cache ops
def write_kv(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Store new tokens' keys and values into their pages.

    Parameters
    ----------
    k, v : float [num_tokens, num_kv_heads, head_dim]
        Any storage dtype; rounded to the cache's where it differs (to nearest even; a float8
        E4M3 cache saturates at +-448, its largest finite number, and keeps NaN).
    k_cache, v_cache : float [num_pages, num_kv_heads, page_size, head_dim]
        Written in place.
    slot_mapping : int [num_tokens]
        ``page * page_size + offset`` of each token; negative = skip (padding).
    k_scale, v_scale : float, optional
        Store k / k_scale and v / v_scale (divided in float32, then rounded): per-tensor scales
        that bring a model's keys and values into a float8 cache's +-448; attention then takes the
        same scales (:func:`paged_decode_attention`). None: 1.
    """
    k_scale, v_scale = _kv_scale(k_scale, "k_scale"), _kv_scale(v_scale, "v_scale")
    kc, vc, kind = _caches(k_cache, v_cache, written=True)
    num_pages, num_kv_heads, page_size, head_dim = kc.shape
    slots = _arrays.int_array(slot_mapping, "slot_mapping", 1).astype(np.int64)
    new = []
    for name, x, factor in (("k", k, k_scale), ("v", v, v_scale)):
        array, x_kind = _arrays.float_storage(x, name, float8=True)
        if array.shape != (slots.shape[0], num_kv_heads, head_dim):
            raise ValueError(f"expected {name} of shape {(slots.shape[0], num_kv_heads, head_dim)}, "
                             f"got {array.shape}")
        if x_kind != kind or factor != 1.0:
            values = _to_float32(array, x_kind)
            if factor != 1.0:
                values = values / np.float32(factor)  # a new array: the caller's k stays as it is
            converted = np.empty(array.shape, kc.dtype)
            _from_float32(values, kind, converted)
            array = converted
        new.append(array)
    if slots.size and slots.max() >= num_pages * page_size:
        i = int(slots.argmax())
        raise InvalidPageError(f"expected slots below {num_pages * page_size} (num_pages * page_size), "
                               f"got {slots[i]} at index {i}")
    valid = slots[slots >= 0]
    if np.unique(valid).size != valid.size:
        raise ValueError("expected distinct slots in slot_mapping, got a repeated slot")
    _threads.start()
    _cache_ops.write_kv(new[0], new[1], kc, vc, slots)


def copy_pages(k_cache, v_cache, src, dst):
    """Copy pages ``src[i] -> dst[i]`` (every head), e.g. the pending copies of copy-on-write.

    Parameters
    ----------
    k_cache, v_cache : float [num_pages, num_kv_heads, page_size, head_dim]
    src, dst : int [num_copies]
        ``dst`` distinct and disjoint from ``src``.
    """
    kc, vc, _ = _caches(k_cache, v_cache, written=True)
    src = _arrays.int_array(src, "src", 1)
    dst = _arrays.int_array(dst, "dst", 1)
    if src.shape != dst.shape:
        raise ValueError(f"expected src and dst of one length, got {src.shape[0]} and {dst.shape[0]}")
    for name, ids in (("src", src), ("dst", dst)):
        if ids.size and (ids.min() < 0 or ids.max() >= kc.shape[0]):
            bad = ids[(ids < 0) | (ids >= kc.shape[0])][0]
            raise InvalidPageError(f"expected {name} page ids in [0, {kc.shape[0]}), got {bad}")
    if np.unique(dst).size != dst.size or np.intersect1d(src, dst).size:
        raise ValueError("expected dst pages distinct and disjoint from src, got an overlap")
    _threads.start()
    _cache_ops.copy_pages(kc, vc, src, dst)


def gather_kv(k_cache, v_cache, block_table, seq_lens):
    """Copy each sequence's paged K/V into dense, packed arrays (a debugging and interop aid).

    Returns
    -------
    k, v : [sum(seq_lens), num_kv_heads, head_dim], the cache's storage dtype
    kv_indptr : int32 [num_seqs + 1]
        Sequence ``s`` owns rows ``kv_indptr[s]:kv_indptr[s+1]``.
    """
    kc, vc, _ = _caches(k_cache, v_cache)
    num_pages, num_kv_heads, page_size, head_dim = kc.shape
    table = _arrays.int_array(block_table, "block_table", 2)
    table, lens = _page_tables(table, seq_lens, table.shape[0], page_size, num_pages)
    indptr = np.zeros(lens.shape[0] + 1, np.int32)
    np.cumsum(lens, out=indptr[1:])
    k_out = np.empty((indptr[-1], num_kv_heads, head_dim), kc.dtype)
    v_out = np.empty_like(k_out)
    _threads.start()
    _cache_ops.gather_kv(kc, vc, table, indptr, k_out, v_out)
    dtype = np.asarray(k_cache).dtype if not _arrays.is_torch(k_cache) else kc.dtype
    if dtype != kc.dtype:  # float16 or ml_dtypes.bfloat16 storage: view the bits back
        k_out, v_out = k_out.view(dtype), v_out.view(dtype)
    return k_out, v_out, indptr


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention results over disjoint key sets (log-sum-exp weighting).

    Parameters
    ----------
    o_a, o_b : float [num_rows, num_heads, head_dim]
    lse_a, lse_b : float32 [num_rows, num_heads]
        Natural-log sums of exp(scores) of each part (-inf for an empty part).

    Returns
    -------
    o : float32 [num_rows, num_heads, head_dim]
    lse : float32 [num_rows, num_heads]
    """
    arrays = []
    for name, x in (("o_a", o_a), ("o_b", o_b)):
        array, kind = _arrays.float_storage(x, name)
        arrays.append(np.ascontiguousarray(_to_float32(array, kind), dtype=np.float32))
    if arrays[0].ndim != 3 or arrays[0].shape != arrays[1].shape:
        raise ValueError(f"expected o_a and o_b of one 3-D shape, got {arrays[0].shape} and {arrays[1].shape}")
    lses = []
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        array = _float32_values(x, name)
        if array.shape != arrays[0].shape[:2]:
            raise ValueError(f"expected {name} of shape {arrays[0].shape[:2]}, got {array.shape}")
        lses.append(array)
    o = np.empty_like(arrays[0])
    lse = np.empty_like(lses[0])
    _threads.start()
    _cache_ops.merge_states(arrays[0], lses[0], arrays[1], lses[1], o, lse)
    return o, lse


def _float32_values(x, name):
    """float32 values of a small per-call array (log-sum-exps, ALiBi slopes), a C-contiguous copy
    unless it is one already: numpy of any float dtype (float64 too, as NumPy computes slopes) or
    a list of floats, or a torch CPU tensor of float32, float64, float16 or bfloat16."""
    if _arrays.is_torch(x):
        import torch  # type: ignore[import-not-found]  # optional: only reached with a tensor

        if x.dtype == torch.float64 and x.device.type == "cpu":
            return x.detach().numpy().astype(np.float32)
        array, kind = _arrays.float_storage(x, name)
        return np.ascontiguousarray(_to_float32(array, kind), dtype=np.float32)
    array = np.asarray(x)
    if array.dtype.kind != "f" and array.dtype.name != "bfloat16":
        raise TypeError(f"expected a float array for {name}, got {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float32)
