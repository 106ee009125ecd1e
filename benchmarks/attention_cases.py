"""The attention benchmark shapes and the implementations compared on them (one registry for the
benchmarks and for their correctness check in test_attention_cases.py).

Shapes (decode, page size 16):
- S1 batch decode: 16 sequences x 2,048 tokens, 32 query heads, 8 KV heads, head_dim 128;
- S2 long context: 1 sequence x 32,768 tokens, same heads;
- S3 small MHA: 64 sequences x 512 tokens, 16/16 heads, head_dim 64.

Prefill (chunked, on a shape's caches): each sequence's last PREFILL_TOKENS tokens are the new
queries, attending causally to the cached tokens before them and to themselves.
"""

import functools
from dataclasses import dataclass

import numba
import numpy as np

from pagekv import KVCache, KVCacheSpec, attention
from pagekv.kernels.convert import narrow_e4m3

SHAPES = {
    "tiny": dict(num_seqs=3, seq_len=100, num_q_heads=8, num_kv_heads=2, head_dim=64),
    "S1": dict(num_seqs=16, seq_len=2048, num_q_heads=32, num_kv_heads=8, head_dim=128),
    "S2": dict(num_seqs=1, seq_len=32768, num_q_heads=32, num_kv_heads=8, head_dim=128),
    "S3": dict(num_seqs=64, seq_len=512, num_q_heads=16, num_kv_heads=16, head_dim=64),
    # GQA groups that are not a multiple of 4 (the tiles' row count): Gemma 2 9B's heads (group 2,
    # head_dim 256), Llama 3.2 3B's (group 3), Qwen2.5-7B's (group 7); and a wide head with a
    # large group, Qwen3-Next's attention layers (group 8, head_dim 256) at S2's length.
    "G2": dict(num_seqs=8, seq_len=2048, num_q_heads=16, num_kv_heads=8, head_dim=256),
    "G3": dict(num_seqs=16, seq_len=2048, num_q_heads=24, num_kv_heads=8, head_dim=128),
    "G7": dict(num_seqs=16, seq_len=2048, num_q_heads=28, num_kv_heads=4, head_dim=128),
    "G8": dict(num_seqs=1, seq_len=32768, num_q_heads=16, num_kv_heads=2, head_dim=256),
}
PAGE_SIZE = 16
KINDS = ("float32", "bfloat16")
PREFILL_TOKENS = 128


@dataclass
class DecodeProblem:
    """One decode step's inputs, in paged (random page order) and dense contiguous forms."""

    q: np.ndarray               # float32 [num_seqs, num_q_heads, head_dim]
    k_cache: np.ndarray         # [num_pages, num_kv_heads, page_size, head_dim], float32 or uint16
    v_cache: np.ndarray
    block_table: np.ndarray     # int32 [num_seqs, pages_per_seq], random page order
    contiguous_table: np.ndarray  # int32, the same data if the pages were laid out in order
    k_contiguous: np.ndarray
    v_contiguous: np.ndarray
    seq_lens: np.ndarray        # int32 [num_seqs]
    kind: str

    @property
    def kv_bytes(self):
        """Bytes of K and V one decode step must read."""
        shape = self.k_cache.shape
        tokens = int(self.seq_lens.sum())
        return 2 * tokens * shape[1] * shape[3] * self.k_cache.itemsize


@functools.lru_cache(maxsize=2)
def problem(shape, kind, page_size=PAGE_SIZE):
    cfg = SHAPES[shape]
    rng = np.random.default_rng(0)
    pages_per_seq = -(-cfg["seq_len"] // page_size)
    num_pages = cfg["num_seqs"] * pages_per_seq
    order = rng.permutation(num_pages).astype(np.int32)
    cache_shape = (num_pages, cfg["num_kv_heads"], page_size, cfg["head_dim"])
    k = rng.standard_normal(cache_shape, dtype=np.float32)
    v = rng.standard_normal(cache_shape, dtype=np.float32)
    if kind == "bfloat16":
        k = (k.view(np.uint32) >> 16).astype(np.uint16)
        v = (v.view(np.uint32) >> 16).astype(np.uint16)
    elif kind == "float16":  # pagekv's cases only (the baselines take float32 and bfloat16)
        k, v = k.astype(np.float16), v.astype(np.float16)
    elif kind == "float8_e4m3fn":  # pagekv's cases only: each number rounded as write_kv rounds it
        k, v = float8_bits(k), float8_bits(v)
    contiguous = np.arange(num_pages, dtype=np.int32).reshape(cfg["num_seqs"], pages_per_seq)
    table = order.reshape(cfg["num_seqs"], pages_per_seq)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"],
                       page_size=page_size, dtype=kind)
    k, v = in_kv_cache(spec, k, v)
    # The contiguous copy holds logical page p of sequence s at physical page s * pages + p.
    k_contiguous, v_contiguous = in_kv_cache(spec, k[table.ravel()], v[table.ravel()])
    q = rng.standard_normal((cfg["num_seqs"], cfg["num_q_heads"], cfg["head_dim"]), dtype=np.float32)
    lens = np.full(cfg["num_seqs"], cfg["seq_len"], np.int32)
    return DecodeProblem(q, k, v, table, contiguous, k_contiguous, v_contiguous, lens, kind)


def float8_bits(values):
    """float8 E4M3 bit patterns (uint8, same shape) of float32 ``values``, as write_kv stores them."""
    bits = np.empty(values.shape, np.uint8)
    narrow_e4m3(np.ascontiguousarray(values, np.float32).reshape(-1), bits.reshape(-1))
    return bits


def in_kv_cache(spec, k, v):
    """K and V pages copied into a one-layer KVCache: stored as the library stores them (where the
    allocation starts matters: pagekv/_arrays.py, START_PAST_4K)."""
    cache = KVCache(spec, k.shape[0])
    cache.k(0)[...], cache.v(0)[...] = k, v
    return cache.k(0), cache.v(0)


def as_float32(storage, kind):
    if kind == "bfloat16":
        return (storage.astype(np.uint32) << 16).view(np.float32)
    return storage.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------------- implementations
def pagekv_decode(p, *, contiguous=False, prefetch=True, resident_pages=None, fast_bf16=True):
    """pagekv's decode kernel, plan made once (as a step does for all its layers); ``prefetch`` and
    ``fast_bf16`` as in ``paged_decode_attention`` (both on by default there too). ``resident_pages=n`` maps every
    logical page onto the first n physical pages, so the step computes as much as ever but reads
    from cache: the loops' speed when memory costs nothing."""
    plan = attention.plan_decode(p.seq_lens, page_size=p.k_cache.shape[2])
    out = np.empty_like(p.q)
    k, v = (p.k_contiguous, p.v_contiguous) if contiguous else (p.k_cache, p.v_cache)
    table = p.contiguous_table if contiguous else p.block_table
    if resident_pages:
        table = table % np.int32(resident_pages)

    def run():
        return attention.paged_decode_attention(p.q, k, v, table, p.seq_lens, out=out, plan=plan,
                                                prefetch=prefetch, fast_bf16=fast_bf16)
    return run


def numpy_gather_decode(p):
    """What a NumPy user writes today: gather the pages into a dense array, then dense attention."""
    num_seqs, num_q_heads, head_dim = p.q.shape
    num_kv_heads = p.k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim)

    def run():
        out = np.empty_like(p.q)
        for s in range(num_seqs):
            pages = p.block_table[s]
            k = as_float32(p.k_cache[pages], p.kind)  # [pages, heads, page_size, head_dim]
            v = as_float32(p.v_cache[pages], p.kind)
            k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :p.seq_lens[s]]
            v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :p.seq_lens[s]]
            q = p.q[s].reshape(num_kv_heads, group, head_dim)
            scores = q @ k.transpose(0, 2, 1) * scale          # [kv_heads, group, tokens]
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            out[s] = (scores @ v).reshape(num_q_heads, head_dim)
        return out
    return run


def _torch_dense(p, cache):
    """A dense torch cache [num_seqs, num_kv_heads, seq_len, head_dim] (float32 or bfloat16) of
    p's contiguous copy (pages in sequence order): the cache users keep today."""
    import torch

    num_seqs, num_kv_heads, head_dim = len(p.seq_lens), cache.shape[1], cache.shape[3]
    tensor = torch.from_numpy(cache.view(np.int16) if p.kind == "bfloat16" else cache)
    if p.kind == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    pages = cache.shape[0] // num_seqs
    dense = tensor.reshape(num_seqs, pages, num_kv_heads, -1, head_dim).transpose(1, 2).reshape(
        num_seqs, num_kv_heads, -1, head_dim)
    return dense[:, :, :int(p.seq_lens[0])].contiguous()  # every sequence has the same length


def torch_sdpa_decode(p):
    """torch's scaled_dot_product_attention on a dense, contiguous cache (the cache users keep today)."""
    import torch

    dtype = torch.float32 if p.kind == "float32" else torch.bfloat16
    k, v = _torch_dense(p, p.k_contiguous), _torch_dense(p, p.v_contiguous)
    q = torch.from_numpy(p.q).to(dtype).unsqueeze(2)  # [num_seqs, num_q_heads, 1, head_dim]

    def run():
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return run


def prefill_queries(p, q_len=PREFILL_TOKENS):
    """New query tokens for a chunked prefill over p's caches: each sequence's last ``q_len``
    positions (float32 [num_seqs * q_len, num_q_heads, head_dim]) and their ``qo_indptr``
    (int32 [num_seqs + 1]); pages already hold their keys and values."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((len(p.seq_lens) * q_len,) + p.q.shape[1:], dtype=np.float32)
    return rows, np.arange(0, len(rows) + 1, q_len, dtype=np.int32)


def prefill_flops(p, q_len=PREFILL_TOKENS):
    """Multiply-add FLOPs of the chunked prefill (2 per multiply-add, scores and values): the query
    at offset i of the chunk attends seq_len - q_len + i + 1 keys."""
    num_q_heads, head_dim = p.q.shape[1:]
    keys = sum(q_len * (int(n) - q_len) + q_len * (q_len + 1) // 2 for n in p.seq_lens)
    return 4 * keys * num_q_heads * head_dim


def pagekv_prefill(p, *, contiguous=False, prefetch=True, q_len=PREFILL_TOKENS):
    """pagekv's chunked prefill over p's pages (see :func:`prefill_queries`)."""
    rows, qo_indptr = prefill_queries(p, q_len)
    out = np.empty_like(rows)
    k, v = (p.k_contiguous, p.v_contiguous) if contiguous else (p.k_cache, p.v_cache)
    table = p.contiguous_table if contiguous else p.block_table
    return lambda: attention.paged_prefill_attention(rows, k, v, table, p.seq_lens, qo_indptr,
                                                     out=out, prefetch=prefetch)


def torch_sdpa_prefill(p, q_len=PREFILL_TOKENS):
    """The same prefill through torch's scaled_dot_product_attention on a dense cache, with the
    causal mask of a chunk that follows cached tokens (query i sees keys up to seq_len - q_len + i).
    Returns [num_seqs, num_q_heads, q_len, head_dim]."""
    import torch

    dtype = torch.float32 if p.kind == "float32" else torch.bfloat16
    rows, _ = prefill_queries(p, q_len)
    k, v = _torch_dense(p, p.k_contiguous), _torch_dense(p, p.v_contiguous)
    num_seqs, seq_len = len(p.seq_lens), int(p.seq_lens[0])
    q = torch.from_numpy(rows).view(num_seqs, q_len, *rows.shape[1:]).transpose(1, 2).to(dtype).contiguous()
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(seq_len - q_len)

    def run():
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                    enable_gqa=True)
    return run


def streaming_read(num_bytes=1 << 29):
    """The machine's streaming-read roof: a vectorised parallel sum over a 512 MiB array."""
    from pagekv.kernels import threads
    from pagekv.kernels.bandwidth import stream_sum

    threads.start()  # as pagekv's own calls start Numba's threads (a torch imported later must not nest)
    data = np.ones(num_bytes // 4, np.float32)
    num_threads = numba.get_num_threads()
    return lambda: stream_sum(data, num_threads), data.nbytes
