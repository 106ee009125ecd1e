"""NumPy twins of the attention kernels: gather each sequence's pages, then dense softmax attention
in float64. Slow and obvious on purpose: they are the tests' oracle and a readable specification.

Caches here are plain float numpy arrays ``[num_pages, num_kv_heads, page_size, head_dim]`` (the
tests widen 16-bit caches to float64 first).
"""

import numpy as np

__all__ = ["gather_sequence", "attention", "decode", "prefill", "write_kv", "copy_pages", "merge_states"]


def gather_sequence(cache, block_table_row, seq_len):
    """The first ``seq_len`` tokens of one sequence, dense: float64 [seq_len, num_kv_heads, head_dim]."""
    page_size = cache.shape[2]
    pages = [cache[block_table_row[p]] for p in range(-(-seq_len // page_size))]
    if not pages:
        return np.zeros((0, cache.shape[1], cache.shape[3]))
    dense = np.concatenate(pages, axis=1)  # [num_kv_heads, tokens, head_dim]
    return dense[:, :seq_len].transpose(1, 0, 2).astype(np.float64)


def attention(q, k, v, q_positions, *, scale=None, sliding_window=None, logits_soft_cap=None,
              alibi_slopes=None):
    """Dense attention of queries at ``q_positions`` over keys at positions 0..len(k)-1.

    q : [num_q, num_q_heads, head_dim]; k, v : [num_k, num_kv_heads, head_dim].
    Returns out float64 [num_q, num_q_heads, head_dim] and lse float64 [num_q, num_q_heads].
    """
    q = np.asarray(q, np.float64)
    num_q, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    out = np.zeros((num_q, num_q_heads, head_dim))
    lse = np.full((num_q, num_q_heads), -np.inf)
    key_pos = np.arange(k.shape[0])
    for i, pos in enumerate(q_positions):
        for h in range(num_q_heads):
            scores = k[:, h // group] @ q[i, h] * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
            if alibi_slopes is not None:
                scores = scores + alibi_slopes[h] * (key_pos - pos)
            visible = key_pos <= pos
            if sliding_window is not None:
                visible &= key_pos > pos - sliding_window
            if not visible.any():
                continue
            scores = scores[visible]
            top = scores.max()
            weights = np.exp(scores - top)
            out[i, h] = weights @ v[visible, h // group] / weights.sum()
            lse[i, h] = top + np.log(weights.sum())
    return out, lse


def decode(q, k_cache, v_cache, block_table, seq_lens, **options):
    """Twin of ``paged_decode_attention``: the query of sequence s sits at position seq_lens[s] - 1."""
    outs, lses = [], []
    for s, seq_len in enumerate(seq_lens):
        k = gather_sequence(k_cache, block_table[s], seq_len)
        v = gather_sequence(v_cache, block_table[s], seq_len)
        o, l = attention(q[s:s + 1], k, v, [seq_len - 1], **options)
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


def prefill(q, k_cache, v_cache, block_table, seq_lens, qo_indptr, **options):
    """Twin of ``paged_prefill_attention``: sequence s's queries are its last q_len positions."""
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for s, seq_len in enumerate(seq_lens):
        rows = slice(qo_indptr[s], qo_indptr[s + 1])
        q_len = qo_indptr[s + 1] - qo_indptr[s]
        k = gather_sequence(k_cache, block_table[s], seq_len)
        v = gather_sequence(v_cache, block_table[s], seq_len)
        out[rows], lse[rows] = attention(q[rows], k, v, range(seq_len - q_len, seq_len), **options)
    return out, lse


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Twin of ``write_kv``, one token at a time."""
    page_size = k_cache.shape[2]
    for i, slot in enumerate(slot_mapping):
        if slot >= 0:
            k_cache[slot // page_size, :, slot % page_size] = k[i]
            v_cache[slot // page_size, :, slot % page_size] = v[i]


def copy_pages(k_cache, v_cache, src, dst):
    """Twin of ``copy_pages``."""
    for s, d in zip(src, dst):
        k_cache[d] = k_cache[s]
        v_cache[d] = v_cache[s]


def merge_states(o_a, lse_a, o_b, lse_b):
    """Twin of ``merge_states`` in float64."""
    top = np.maximum(lse_a, lse_b)
    safe = np.where(np.isinf(top), 0.0, top)
    wa, wb = np.exp(lse_a - safe), np.exp(lse_b - safe)
    total = wa + wb
    with np.errstate(invalid="ignore", divide="ignore"):
        o = (wa[..., None] * o_a + wb[..., None] * o_b) / total[..., None]
        lse = safe + np.log(total)
    return np.where(total[..., None] > 0, o, 0.0), np.where(total > 0, lse, -np.inf)
