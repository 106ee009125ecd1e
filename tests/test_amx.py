"""The AMX prefill and decode kernels (kernels/amx_attention.py) on CPUs with AMX-BF16; skipped
elsewhere.

Where they run, test_attention.py's prefill and decode tests take them too (bfloat16 pages,
head_dim a multiple of 32, page size a multiple of 16); these tests pin their pieces and compare
them with the ``vdpbf16ps`` kernels, which round the same inputs the same way, on the shapes that
reach every branch: 1-8 row groups in prefill (past the four a key tile feeds at once), GQA
groups of 1-16 in decode (the tile shapes follow the group), an odd number of 32-dim chunks,
pages of 16-256 tokens ending mid-tile, rows past a sequence's end holding NaN, sequences split
across threads, and softmax chunks with and without masks (two code paths).
"""

import numpy as np
import pytest
from numba import njit

from kv_builders import FAST_BF16_TOLERANCE, PagedKV, relative_error, to_storage, widen
from pagekv import attention
from pagekv.kernels import _amx, amx_attention
from pagekv.kernels._dtypes import FORMAT_BFLOAT16, FORMAT_FLOAT32
from pagekv.reference import attention as reference

pytestmark = pytest.mark.skipif(not _amx.AVAILABLE, reason="this CPU (or kernel) gives no AMX-BF16")


@njit
def _transpose(keys, out):
    for c in range(out.shape[0]):
        _amx.transpose_words(keys.ctypes.data + 64 * c, keys.strides[0], out[c].ctypes.data, 64)


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_transpose_words_pairs_dims_by_key(head_dim):
    rng = np.random.default_rng(head_dim)
    keys = rng.integers(0, 2**16, (16, head_dim), dtype=np.uint16)
    out = np.zeros((head_dim // 32, 16, 16), np.uint32)
    _transpose(keys, out)
    words = keys.view(np.uint32)  # word j of key n: dims 2j (low half), 2j + 1 (high half)
    expected = words.reshape(16, head_dim // 32, 16).transpose(1, 2, 0)  # [chunk, k, n]
    np.testing.assert_array_equal(out, expected)


@njit
def _transpose_block(source, target):
    _amx.transpose_words(source.ctypes.data, source.strides[0], target.ctypes.data, target.strides[0])


def test_transpose_words_moves_a_block_between_any_row_steps():
    """Decode's scores: a block of 16 x 16 float32 words inside wider arrays, nothing else written."""
    source = np.random.default_rng(1).standard_normal((20, 33)).astype(np.float32)
    target = np.full((18, 21), -3.0, np.float32)
    _transpose_block(source[2:, 5:], target[1:, 3:])
    np.testing.assert_array_equal(target[1:17, 3:19], source[2:18, 5:21].T)
    target[1:17, 3:19] = -3.0
    assert (target == -3.0).all()


def test_acc_dim_lists_even_then_odd_dims_of_each_chunk():
    order = [_amx.acc_dim(j) for j in range(96)]
    for base in (0, 32, 64):
        assert order[base:base + 16] == list(range(base, base + 32, 2))
        assert order[base + 16:base + 32] == list(range(base + 1, base + 32, 2))


@njit
def _one_tile(queries, keys_t, scores, probs, value_pairs, acc):
    config = _amx.tile_config()
    _amx.configure(config.ctypes.data)
    groups = queries.shape[0] // 16
    _amx.score_tiles(queries.ctypes.data, queries.strides[0], keys_t.ctypes.data, groups,
                     keys_t.shape[0], scores.ctypes.data, scores.strides[0], 0, 0)
    count = acc.shape[1] // 16
    _amx.load_sums(acc.ctypes.data, _amx.ROW_BYTES, acc.strides[0], count)
    _amx.accumulate_pairs(probs.ctypes.data, probs.strides[0], value_pairs.ctypes.data,
                          value_pairs.strides[0], count)
    _amx.store_sums(acc.ctypes.data, _amx.ROW_BYTES, acc.strides[0], count)
    _amx.release()


@pytest.mark.parametrize("groups, dims", [(1, 64), (3, 48), (4, 32)])
def test_tiles_multiply_as_numpy(groups, dims):
    """Scores of 16-64 query rows x 16 keys; value sums of 16 rows x 32 tokens x 32-64 dims (2-4
    tiles), added to what the sums held and no dims past them (bfloat16 products are exact in
    float32: only the order of sums differs)."""
    rng = np.random.default_rng(groups)
    queries = to_storage(rng.standard_normal((16 * groups, 64)), "bfloat16")
    keys = to_storage(rng.standard_normal((16, 64)), "bfloat16")
    keys_t = np.zeros((2, 16, 16), np.uint32)
    _transpose(keys, keys_t)
    scores = np.zeros((16 * groups, 20), np.float32)
    p = to_storage(rng.random((16, 32)), "bfloat16")
    probs = np.zeros((16, 20), np.uint32)
    probs[:, :16] = p.view(np.uint32)  # tokens 2j (low half) and 2j + 1 (high half) in word j
    values = to_storage(rng.standard_normal((32, 64)), "bfloat16")
    value_pairs = values[0::2].astype(np.uint32) | (values[1::2].astype(np.uint32) << 16)
    acc = rng.standard_normal((16, 80)).astype(np.float32)
    before = acc.copy()
    _one_tile(queries, keys_t, scores, probs, value_pairs, acc[:, :dims])
    f = lambda bits: widen(bits, "bfloat16")  # noqa: E731
    np.testing.assert_allclose(scores[:, :16], f(queries) @ f(keys).T, rtol=1e-5, atol=1e-4)
    expected = before.astype(np.float64)
    expected[:, :dims] += f(p) @ f(values[:, :dims])
    np.testing.assert_allclose(acc, expected, rtol=1e-5, atol=1e-4)


def test_applies_to_the_shapes_it_takes_only():
    def cache(page_size, head_dim):
        return np.zeros((2, 1, page_size, head_dim), np.uint16)

    assert amx_attention.applies(cache(16, 128), FORMAT_BFLOAT16, True)
    assert amx_attention.applies(cache(256, 64), FORMAT_BFLOAT16, True)
    assert not amx_attention.applies(cache(16, 128), FORMAT_BFLOAT16, False)  # fast_bf16=False
    assert not amx_attention.applies(cache(16, 80), FORMAT_BFLOAT16, True)
    assert not amx_attention.applies(cache(8, 128), FORMAT_BFLOAT16, True)
    assert not amx_attention.applies(np.zeros((2, 1, 16, 128), np.float32), FORMAT_FLOAT32, True)


def _nan_past_the_end(kv):
    """kv with every row past a sequence's end (in its last page) NaN: never to be read."""
    page_size = kv.k.shape[2]
    for s, n in enumerate(kv.seq_lens):
        if n % page_size:
            kv.k[kv.block_table[s, n // page_size], :, n % page_size:] = 0x7FC0
            kv.v[kv.block_table[s, n // page_size], :, n % page_size:] = 0x7FC0
    return kv


def _vdpbf16ps_prefill(monkeypatch, *args, **options):
    with monkeypatch.context() as patch:
        patch.setattr(amx_attention, "applies", lambda *a: False)
        return attention.paged_prefill_attention(*args, **options)


# The plain softmax (none of soft cap and ALiBi) and the other, each with a window
PLAIN_AND_OTHER_OPTIONS = [{}, {"sliding_window": 40},
                           {"sliding_window": 40, "logits_soft_cap": 30.0, "alibi_slopes": True,
                            "scale": 0.05}]


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size, head_dim", [(16, 128), (32, 96), (256, 64), (16, 256)])
@pytest.mark.parametrize("options", PLAIN_AND_OTHER_OPTIONS)
@pytest.mark.parametrize("tokens_per_item", [16, 48, 128])
def test_prefill_matches_the_vdpbf16ps_kernel_and_the_reference(monkeypatch, group, page_size,
                                                                head_dim, options, tokens_per_item):
    """Items of one block, of three, and of eight (the query lengths end mid-block and mid-item;
    a block whose keys all lie past its queries or before its window skips that chunk)."""
    monkeypatch.setattr(amx_attention, "item_tokens", lambda *a: tokens_per_item)
    rng = np.random.default_rng(group * page_size + head_dim)
    seq_lens = [1, 17, 63, 64, 97, 300, 600]  # 600: whole chunks before the first query (unmasked)
    kv = _nan_past_the_end(PagedKV(rng, seq_lens, num_kv_heads=2, head_dim=head_dim,
                                   page_size=page_size, kind="bfloat16"))
    q_lens = [1, 17, 40, 64, 33, 129, 40]
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_q_heads = 2 * group
    q = rng.standard_normal((qo_indptr[-1], num_q_heads, head_dim)).astype(np.float32)
    options = dict(options)
    if options.pop("alibi_slopes", False):
        options["alibi_slopes"] = (2.0 ** -np.arange(1, num_q_heads + 1)).astype(np.float32)
    args = (q, kv.k, kv.v, kv.block_table, kv.seq_lens, qo_indptr)
    out, lse = attention.paged_prefill_attention(*args, return_lse=True, **options)
    twin_out, twin_lse = _vdpbf16ps_prefill(monkeypatch, *args, return_lse=True, **options)
    assert np.isfinite(out).all()
    # Scores summed in another order can round a probability to its other bfloat16 neighbour:
    # one such flip moves an output by up to p * 2^-8 of a value row, so up to ~4e-3 where one
    # key takes nearly all the weight (measured: 2.5e-5 typical, 1.9e-3 with ALiBi at scale 0.05).
    assert relative_error(out, twin_out) <= 2.0**-8
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-5, atol=1e-5)
    q_rounded = widen(to_storage(q, "bfloat16"), "bfloat16")
    expected, expected_lse = reference.prefill(q_rounded, kv.k64, kv.v64, kv.block_table, kv.seq_lens,
                                               qo_indptr, **options)
    assert relative_error(out, expected) <= FAST_BF16_TOLERANCE
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


def test_prefill_items_hold_up_to_512_rows_and_leave_every_slot_work():
    block, most = amx_attention.QUERY_BLOCK, amx_attention.ITEM_ROWS
    assert amx_attention.item_tokens(16 * 128, 4, 8, 8) == 128   # S1's chunked prefill: 128 items
    assert amx_attention.item_tokens(64 * 128, 1, 16, 8) == 512  # S3's (MHA)
    assert amx_attention.item_tokens(16 * 128, 7, 4, 8) == 64    # 7 heads a group: 448 rows
    assert amx_attention.item_tokens(1, 4, 1, 8) == block        # one token: one block
    assert amx_attention.item_tokens(324, 4, 2, 8) == 32         # 648 token-heads: 20 items for 8 slots
    for tokens, group, heads, slots in [(1, 1, 1, 8), (97, 2, 2, 8), (324, 16, 2, 16), (4096, 1, 1, 8),
                                        (100_000, 3, 8, 64)]:
        n = amx_attention.item_tokens(tokens, group, heads, slots)
        assert n % block == 0 and block <= n and (n == block or n * group <= most)
        assert n == block or -(-tokens // n) * heads >= amx_attention.ITEMS_PER_SLOT * slots


def _decode(monkeypatch, amx, *args, **options):
    """Decode by the AMX kernel (amx True: also where it is not picked for speed) or the
    vdpbf16ps one."""
    with monkeypatch.context() as patch:
        patch.setattr(amx_attention, "applies_to_decode", lambda *a: amx)
        return attention.paged_decode_attention(*args, **options)


@njit
def _decode_scores(keys, q_t, group, scores):
    configs = _amx.decode_configs(group)
    _amx.configure(configs.ctypes.data)
    _amx.score_tiles(keys.ctypes.data, keys.strides[0], q_t.ctypes.data, 1, q_t.shape[0],
                     scores.ctypes.data, scores.strides[0], 0, 0)
    _amx.release()


@pytest.mark.parametrize("group", [1, 5, 16])
def test_decode_scores_hold_one_key_per_row(group):
    """S^T = K Q^T by the decode configuration: 16 keys as they lie x the group's queries in
    pairs of dims; the tile writes ``group`` scores per key and not one float past them."""
    rng = np.random.default_rng(group)
    queries = to_storage(rng.standard_normal((group, 96)), "bfloat16")
    keys = to_storage(rng.standard_normal((16, 96)), "bfloat16")
    q_t = np.zeros((1, 3, 16, 16), np.uint32)
    amx_attention._queries_by_pairs(queries, group, q_t)
    scores = np.full((16, 17), -7.0, np.float32)
    _decode_scores(keys, q_t[0], group, scores)
    f = lambda bits: widen(bits, "bfloat16")  # noqa: E731
    np.testing.assert_allclose(scores[:, :group], f(keys) @ f(queries).T, rtol=1e-5, atol=1e-4)
    assert (scores[:, group:] == -7.0).all()


@pytest.mark.parametrize("group", [1, 3, 4, 11, 16])
@pytest.mark.parametrize("page_size, head_dim", [(16, 128), (32, 96), (256, 64), (16, 256)])
@pytest.mark.parametrize("options", PLAIN_AND_OTHER_OPTIONS)
def test_decode_matches_the_vdpbf16ps_kernel_and_the_reference(monkeypatch, group, page_size,
                                                               head_dim, options):
    rng = np.random.default_rng(group * page_size + head_dim)
    seq_lens = [1, 17, 63, 64, 97, 300, 2000]  # 2000: split across threads
    kv = _nan_past_the_end(PagedKV(rng, seq_lens, num_kv_heads=2, head_dim=head_dim,
                                   page_size=page_size, kind="bfloat16"))
    num_q_heads = 2 * group
    q = rng.standard_normal((len(seq_lens), num_q_heads, head_dim)).astype(np.float32)
    options = dict(options)
    if options.pop("alibi_slopes", False):
        options["alibi_slopes"] = (2.0 ** -np.arange(1, num_q_heads + 1)).astype(np.float32)
    plan = attention.plan_decode(kv.seq_lens, page_size=page_size,
                                 sliding_window=options.get("sliding_window"), num_threads=3)
    assert len(plan.split_seqs) > 0 or "sliding_window" in options  # a window: 40 keys, no split
    args = (q, kv.k, kv.v, kv.block_table, kv.seq_lens)
    out, lse = _decode(monkeypatch, True, *args, return_lse=True, plan=plan, **options)
    twin_out, twin_lse = _decode(monkeypatch, False, *args, return_lse=True, plan=plan, **options)
    assert np.isfinite(out).all()
    assert relative_error(out, twin_out) <= 2.0**-8  # as in prefill: a probability's rounding
    np.testing.assert_allclose(lse, twin_lse, rtol=1e-5, atol=1e-5)
    q_rounded = widen(to_storage(q, "bfloat16"), "bfloat16")
    expected, expected_lse = reference.decode(q_rounded, kv.k64, kv.v64, kv.block_table,
                                              kv.seq_lens, **options)
    assert relative_error(out, expected) <= FAST_BF16_TOLERANCE
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


def test_decode_applies_where_it_measured_faster():
    def cache(page_size, head_dim):
        return np.zeros((2, 1, page_size, head_dim), np.uint16)

    for group in (2, 3, 4, 7, 16):
        assert amx_attention.applies_to_decode(cache(16, 128), FORMAT_BFLOAT16, True, group)
    assert amx_attention.applies_to_decode(cache(256, 64), FORMAT_BFLOAT16, True, 4)
    assert not amx_attention.applies_to_decode(cache(16, 128), FORMAT_BFLOAT16, True, 1)
    assert not amx_attention.applies_to_decode(cache(16, 128), FORMAT_BFLOAT16, True, 17)
    for group in (4, 8, 16):
        assert amx_attention.applies_to_decode(cache(16, 256), FORMAT_BFLOAT16, True, group)
    for group in (2, 3):  # wider heads take AMX from a group of 4
        assert not amx_attention.applies_to_decode(cache(16, 256), FORMAT_BFLOAT16, True, group)
    assert not amx_attention.applies_to_decode(cache(16, 128), FORMAT_BFLOAT16, False, 4)
    assert not amx_attention.applies_to_decode(cache(8, 128), FORMAT_BFLOAT16, True, 4)


@pytest.mark.parametrize("num_heads, page_end, chunk_pages", [(8, 40, 16), (1, 5, 2), (3, 7, 3)])
def test_decode_prefetches_in_its_own_visit_order(num_heads, page_end, chunk_pages):
    """_visits lists a chunk's K blocks head by head, its V blocks alike, the next chunk's K
    blocks (a Python list is the reference); _ahead takes the entries each of its three distances
    (far, near, primed) visits on, and none past the list or at distance 0."""
    table = np.random.default_rng(3).permutation(page_end + 2).astype(np.int32)[None, :page_end]
    k = np.zeros((page_end + 2, num_heads, 16, 32), np.uint16)
    v = np.zeros_like(k)
    out = np.zeros(3 * chunk_pages * num_heads, np.int64)

    def blocks(cache, begin, end):
        return [cache[table[0, p], h].ctypes.data for h in range(num_heads) for p in range(begin, end)]

    for first in range(0, page_end, chunk_pages):
        last = min(first + chunk_pages, page_end)
        n = amx_attention._visits(k, v, table, 0, first, last, page_end, chunk_pages, out)
        expected = (blocks(k, first, last) + blocks(v, first, last)
                    + blocks(k, last, min(last + chunk_pages, page_end)))
        assert out[:n].tolist() == expected
        for i in range(n):
            for distances in ((0, 0, 0), (1, 0, 2), (2, 1, 3), (n, 3, n - 1)):
                got = amx_attention._ahead(out, n, i, distances)
                assert got == tuple(expected[i + d] if 0 < d and i + d < n else 0 for d in distances)
