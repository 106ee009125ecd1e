"""Paged attention kernels against their float64 NumPy twins, on awkward shapes and every dtype."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_builders import (FAST_BF16_TOLERANCE, TOLERANCE, PagedKV, bf16_products, relative_error,
                         slots_per_thread, takes_fast_bf16, to_storage, widen)
from pagekv import attention
from pagekv.kernels import attention as kernel_attention
from pagekv.kernels import slots
from pagekv.kernels.page_loops import KEY_LANE_ROWS
from pagekv.reference import attention as reference

HEAD_DIMS = [64, 72, 80, 96, 128, 256]  # 72: not a multiple of 16, so Numba's loops, not tiles
PAGE_SIZES = [1, 2, 16, 17, 64, 256]
KINDS = ["float32", "float16", "bfloat16"]  # of queries and outputs
CACHE_KINDS = [*KINDS, "float8_e4m3fn"]


@st.composite
def problems(draw, *, max_len=300):
    num_kv_heads = draw(st.integers(1, 3))
    return dict(
        seq_lens=draw(st.lists(st.sampled_from([1, 2, 15, 16, 17, 63, 64, 65, 97, 1, max_len]) |
                               st.integers(1, max_len), min_size=1, max_size=4)),
        num_kv_heads=num_kv_heads,
        group=draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8])),  # tiles of 4 rows, 3/2/1 rows, both
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        kind=draw(st.sampled_from(CACHE_KINDS)),
        q_kind=draw(st.sampled_from(KINDS)),
        options=draw(st.fixed_dictionaries({}, optional={
            "sliding_window": st.integers(1, 80),
            "logits_soft_cap": st.sampled_from([5.0, 30.0]),
            "alibi_slopes": st.just("alibi"),
            "scale": st.floats(0.01, 0.5),
            "fast_bf16": st.booleans(),
        })),
        bf16_products=draw(st.booleans()),  # both bfloat16 paths on every CPU
        seed=draw(st.integers(0, 2**16)),
    )


def build(problem):
    rng = np.random.default_rng(problem["seed"])
    kv = PagedKV(rng, problem["seq_lens"], num_kv_heads=problem["num_kv_heads"],
                 head_dim=problem["head_dim"], page_size=problem["page_size"], kind=problem["kind"])
    num_q_heads = problem["num_kv_heads"] * problem["group"]
    options = dict(problem["options"])
    if "alibi_slopes" in options:
        options["alibi_slopes"] = (2.0 ** -np.arange(1, num_q_heads + 1)).astype(np.float32)
    return rng, kv, num_q_heads, options


def reference_options(options):
    return {name: value for name, value in options.items() if name != "fast_bf16"}


def query(rng, shape, kind):
    storage = to_storage(rng.standard_normal(shape), kind)
    return (storage.view(np.float16) if kind == "float16" else storage), widen(storage, kind)


def fast_path(problem):
    return takes_fast_bf16(problem["kind"], problem["head_dim"], problem["page_size"],
                           problem["options"].get("fast_bf16", True), problem["bf16_products"])


def reference_query(q64, problem):
    """The query the kernel multiplies with: rounded to bfloat16 on the fast path, so the scores
    and lse compare tightly and only the probabilities' rounding is left in the output."""
    return widen(to_storage(q64, "bfloat16"), "bfloat16") if fast_path(problem) else q64


def check(got, expected, kind, problem):
    got = np.asarray(got)
    got_values = widen(got.view(np.uint16), kind) if kind == "bfloat16" else got.astype(np.float64)
    assert not np.isnan(got_values).any()
    tolerance = max(TOLERANCE[kind], FAST_BF16_TOLERANCE if fast_path(problem) else 0)
    assert relative_error(got_values, expected) <= tolerance


@given(problems())
def test_decode_matches_reference(problem):
    rng, kv, num_q_heads, options = build(problem)
    q, q64 = query(rng, (len(kv.seq_lens), num_q_heads, problem["head_dim"]), problem["q_kind"])
    with bf16_products(problem["bf16_products"]):
        out, lse = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                    return_lse=True, **options)
    expected, expected_lse = reference.decode(reference_query(q64, problem), kv.k64, kv.v64,
                                              kv.block_table, kv.seq_lens, **reference_options(options))
    assert out.shape == q.shape and out.dtype == q.dtype
    check(out, expected, problem["q_kind"], problem)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


@given(problems(max_len=120), st.data())
def test_prefill_matches_reference(problem, data):
    rng, kv, num_q_heads, options = build(problem)
    q_lens = [data.draw(st.integers(1, n)) for n in kv.seq_lens]  # the rest is a cached prefix
    qo_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, q64 = query(rng, (qo_indptr[-1], num_q_heads, problem["head_dim"]), problem["q_kind"])
    with bf16_products(problem["bf16_products"]):
        out, lse = attention.paged_prefill_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                     qo_indptr, return_lse=True, **options)
    expected, expected_lse = reference.prefill(reference_query(q64, problem), kv.k64, kv.v64,
                                               kv.block_table, kv.seq_lens, qo_indptr,
                                               **reference_options(options))
    check(out, expected, problem["q_kind"], problem)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("page_size, head_dim", [(1, 64), (16, 80), (17, 128), (64, 256)])
def test_fma_decode_tiles_match_reference(page_size, head_dim, group, kind):
    """float32, float16, float8 and (without bfloat16 products) bfloat16 pages take decode's FMA tiles
    (kernels/page_loops.py): tiles of 1, 2, 3 or 4 query rows per KV head, and 4-row tiles plus a
    1-, 2- or 3-row tile for the rest (groups 5-7); odd page sizes, pages ending mid-way, every
    head_dim chunk count, with the masking options."""
    rng = np.random.default_rng(page_size)
    kv = PagedKV(rng, [1, 17, 97, 300], num_kv_heads=3, head_dim=head_dim, page_size=page_size,
                 kind=kind)
    q = rng.standard_normal((4, 3 * group, head_dim)).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, 3 * group + 1)).astype(np.float32)
    for options in ({}, {"sliding_window": 40, "logits_soft_cap": 5.0, "alibi_slopes": slopes}):
        with bf16_products(False):
            out, lse = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table,
                                                        kv.seq_lens, return_lse=True, **options)
        expected, expected_lse = reference.decode(q.astype(np.float64), kv.k64, kv.v64,
                                                  kv.block_table, kv.seq_lens, **options)
        assert relative_error(out, expected) <= TOLERANCE["float32"]  # float32 math on the stored values
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_prefetch_changes_no_result(kind):
    """Prefetch only moves data closer: outputs are bit-identical off, on, and at any distance
    (1 byte = one block ahead, 10**6 = past every item's end)."""
    rng = np.random.default_rng(11)
    kv = PagedKV(rng, [1, 17, 97, 300], num_kv_heads=2, head_dim=64, page_size=16, kind=kind)
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    qo_indptr = np.array([0, 1, 10, 50, 150], np.int32)
    rows = rng.standard_normal((150, 8, 64)).astype(np.float32)
    decode_off = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                  prefetch=False)
    prefill_off = attention.paged_prefill_attention(rows, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                    qo_indptr, prefetch=False)
    for prefetch in (True, 1, 5000, 10**6):
        np.testing.assert_array_equal(
            attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                             prefetch=prefetch), decode_off)
        np.testing.assert_array_equal(
            attention.paged_prefill_attention(rows, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                              qo_indptr, prefetch=prefetch), prefill_off)


@pytest.mark.parametrize("kind, page_size, head_dim, prefetch, blocks", [
    ("bfloat16", 16, 128, 65536, (16, 2)),   # 4 KiB blocks: 64 KiB ahead, again 8 KiB ahead
    ("float32", 16, 128, 65536, (8, 1)),     # 8 KiB blocks
    ("float32", 17, 80, 65536, (13, 2)),     # 5,440-byte blocks: distances round up
    ("bfloat16", 256, 128, 65536, (1, 0)),   # 64 KiB blocks: nothing nearer than one block
    ("bfloat16", 2, 128, 65536, (128, 16)),  # 512-byte blocks: still asked again
    ("bfloat16", 2, 64, 65536, (256, 0)),    # 256-byte blocks: not
    ("bfloat16", 16, 128, 16384, (4, 1)),    # AVX2's default: 16 KiB ahead, again one block
    ("float32", 16, 64, 1, (1, 0)),
    ("float32", 16, 64, 5000, (2, 1)),
    ("float32", 16, 64, False, (0, 0)),
])
def test_prefetch_distances_in_blocks(kind, page_size, head_dim, prefetch, blocks):
    """The far distance (PREFETCH_BYTES for True) and the second, nearer one (an eighth of it) in
    whole head blocks, rounded up; the nearer one is dropped unless it is nearer, and for blocks
    under 512 bytes."""
    from pagekv.attention import PREFETCH_BYTES, _prefetch_blocks

    cache = np.zeros((2, 1, page_size, head_dim), np.float32 if kind == "float32" else np.uint16)
    assert _prefetch_blocks(prefetch, cache) == blocks
    assert _prefetch_blocks(True, cache) == _prefetch_blocks(PREFETCH_BYTES, cache)


@pytest.mark.parametrize("num_heads, page_end, chunk_pages", [(8, 40, 16), (1, 5, 2), (3, 7, 3)])
def test_prefetch_targets_follow_the_visit_order(num_heads, page_end, chunk_pages):
    """_block_ahead names the block `distance` visits ahead: a chunk's K blocks, its V blocks, the
    next chunk's K blocks, ... (a Python list of the visits is the reference), and none past the
    item's last visit."""
    from pagekv.kernels.attention import _block_ahead

    table = np.random.default_rng(3).permutation(1000)[:page_end].astype(np.int32)[None, :]
    visits = []  # (pass number, in_v, logical page, head, chunk first, chunk last)
    passes = ((first, in_v) for first in range(0, page_end, chunk_pages) for in_v in (False, True))
    for pass_number, (first, in_v) in enumerate(passes):
        last = min(first + chunk_pages, page_end)
        visits += [(pass_number, in_v, p, h, first, last)
                   for p in range(first, last) for h in range(num_heads)]
    for distance in (0, 1, 2, num_heads * chunk_pages + 1):
        for i, (pass_number, v_pass, p, h, first, last) in enumerate(visits):
            got = _block_ahead(table, 0, p, h, num_heads, first, last, page_end, chunk_pages, v_pass,
                               distance)
            # Targets lie in the pass being read or the next one; none past the item's end.
            if distance == 0 or i + distance >= len(visits) or visits[i + distance][0] > pass_number + 1:
                assert got[1] == -1, (i, distance)
            else:
                in_v, page, head = visits[i + distance][1:4]
                assert got == (in_v, table[0, page], head), (i, distance)


@pytest.mark.parametrize("kind, products", [("bfloat16", True), ("float32", False),
                                            ("float16", False), ("bfloat16", False),
                                            ("float8_e4m3fn", False), ("float8_e4m3fn", True)])
@pytest.mark.parametrize("page_size, head_dim, group", [(16, 128, 2), (18, 80, 4), (48, 256, 3),
                                                      (64, 112, 8), (32, 64, 1)])
def test_prefill_many_row_tiles_match_reference(page_size, head_dim, group, kind, products):
    """Prefill with 32 or more query rows per item scores each whole 16 of a page's keys by the
    key-lane tiles (kernels/_key_lanes.py; AVX-512 only, elsewhere other tiles pass it), of every
    kind: vdpbf16ps (bfloat16 and float8 pages), and the FMA tiles of each storage; with
    vdpbf16ps each 8 rows take a chunk's value blocks in one tile (EIGHT_ROWS_CHUNK; float8
    items of 64 rows or more over blocks turned into bfloat16 once). Page sizes that are and are
    not multiples of 16 (18: 16 keys by them, 2 by the others), pages ending mid-way, items of
    32-128 rows, some in tiles of 16 rows and a rest (13 tokens x group 3, 4 or 8), MHA's items
    of 32 tokens, and items under 32 rows, with the masking options."""
    rng = np.random.default_rng(page_size)
    kv = PagedKV(rng, [40, 97, 300], num_kv_heads=2, head_dim=head_dim, page_size=page_size, kind=kind)
    qo_indptr = np.array([0, 16, 61, 191], np.int32)  # 45 tokens: 16, 16, then 13 x group rows
    q = to_storage(rng.standard_normal((191, 2 * group, head_dim)), "bfloat16")
    q64 = widen(q, "bfloat16")
    slopes = (2.0 ** -np.arange(1, 2 * group + 1)).astype(np.float32)
    problem = dict(kind=kind, head_dim=head_dim, page_size=page_size, options={},
                   bf16_products=products)
    for options in ({}, {"sliding_window": 40, "logits_soft_cap": 5.0, "alibi_slopes": slopes}):
        with bf16_products(products):
            out, lse = attention.paged_prefill_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                         qo_indptr, return_lse=True, **options)
        expected, expected_lse = reference.prefill(q64, kv.k64, kv.v64, kv.block_table, kv.seq_lens,
                                                   qo_indptr, **options)
        check(out, expected, "bfloat16", problem)
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", [1, 4, 5, 8])
@pytest.mark.parametrize("page_size, head_dim", [(16, 128), (2, 16), (18, 80), (64, 256), (256, 128)])
def test_float8_pages_multiply_as_bfloat16_pages_of_the_same_numbers(page_size, head_dim, group):
    """float8 numbers are bfloat16 numbers: with bfloat16 products, attention over float8 pages
    equals, bit for bit, attention over bfloat16 pages holding the same numbers. Decode with one
    row tile per block (groups 1-4) turns each row as the tile loads it; groups 5-8 turn each
    block once into a stack buffer (kernels/_float8_rows.py), except blocks over its 32 KiB (256
    x 128); head_dim 16 and 80 end in 16-number pieces; prefill takes its many-row tiles."""
    rng = np.random.default_rng(group * 1000 + page_size)
    kv = PagedKV(rng, [1, 17, 97, 300], num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                 kind="float8_e4m3fn")
    k_bf16, v_bf16 = to_storage(kv.k64, "bfloat16"), to_storage(kv.v64, "bfloat16")  # exact
    q = rng.standard_normal((4, 2 * group, head_dim)).astype(np.float32)
    rows = rng.standard_normal((140, 2 * group, head_dim)).astype(np.float32)
    qo_indptr = np.array([0, 1, 10, 40, 140], np.int32)
    plan = attention.plan_decode(kv.seq_lens, page_size=page_size)  # the same split for both
    outs = []
    with bf16_products(True):
        for k, v in ((kv.k, kv.v), (k_bf16, v_bf16)):
            decode = attention.paged_decode_attention(q, k, v, kv.block_table, kv.seq_lens, plan=plan)
            outs.append((decode, attention.paged_prefill_attention(rows, k, v, kv.block_table,
                                                                   kv.seq_lens, qo_indptr)))
    for float8_out, bfloat16_out in zip(*outs):
        np.testing.assert_array_equal(float8_out, bfloat16_out)


@pytest.mark.parametrize("kind, products", [("float8_e4m3fn", True), ("float8_e4m3fn", False),
                                            ("bfloat16", True), ("float32", False)])
def test_scales_multiply_the_stored_keys_and_values(kind, products):
    """A cache holding k / k_scale and v / v_scale, read with those scales, is attention over k
    and v: the scores take scale * k_scale, the outputs v_scale (before rounding to q's dtype);
    the log-sum-exp is that of the true scores. Decode (split and whole) and prefill, with a
    soft cap, on both products."""
    rng = np.random.default_rng(4)
    kv = PagedKV(rng, [1, 17, 97, 300], num_kv_heads=2, head_dim=64, page_size=16, kind=kind)
    k_scale, v_scale = 3.0, 0.25
    true_k, true_v = kv.k64 * k_scale, kv.v64 * v_scale
    q = to_storage(rng.standard_normal((4, 8, 64)), "bfloat16")  # exact on every path
    rows = to_storage(rng.standard_normal((40, 8, 64)), "bfloat16")
    qo_indptr = np.array([0, 1, 10, 20, 40], np.int32)
    options = dict(logits_soft_cap=30.0, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    tolerance = max(TOLERANCE["float32"], FAST_BF16_TOLERANCE if products and kind != "float32" else 0)
    with bf16_products(products):
        for threads in (1, 7):
            plan = attention.plan_decode(kv.seq_lens, page_size=16, num_threads=threads)
            out, lse = attention.paged_decode_attention(widen(q, "bfloat16").astype(np.float32), kv.k,
                                                        kv.v, kv.block_table, kv.seq_lens, plan=plan,
                                                        **options)
            expected, expected_lse = reference.decode(widen(q, "bfloat16"), true_k, true_v,
                                                      kv.block_table, kv.seq_lens, logits_soft_cap=30.0)
            assert relative_error(out, expected) <= tolerance
            np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)
        out, lse = attention.paged_prefill_attention(widen(rows, "bfloat16").astype(np.float32), kv.k,
                                                     kv.v, kv.block_table, kv.seq_lens, qo_indptr,
                                                     **options)
    expected, expected_lse = reference.prefill(widen(rows, "bfloat16"), true_k, true_v, kv.block_table,
                                               kv.seq_lens, qo_indptr, logits_soft_cap=30.0)
    assert relative_error(out, expected) <= tolerance
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("group", range(1, 17))
def test_prefill_items_hold_the_rows_the_many_row_tiles_take(group):
    """A prefill item of a small GQA group takes more query tokens (MHA: 32), so that it has the
    KEY_LANE_ROWS rows from which the key-lane and chunk value tiles serve it; larger groups keep
    QUERY_BLOCK tokens."""
    tokens = kernel_attention.query_tokens(group)
    assert tokens >= kernel_attention.QUERY_BLOCK
    assert tokens * group >= KEY_LANE_ROWS
    assert tokens == kernel_attention.QUERY_BLOCK or (tokens - 1) * group < KEY_LANE_ROWS


def test_prefill_of_whole_prompt_equals_decode_of_last_token():
    rng = np.random.default_rng(7)
    kv = PagedKV(rng, [97, 33], num_kv_heads=2, head_dim=80, page_size=16, kind="float32")
    qo_indptr = np.array([0, 97, 130], np.int32)
    q = rng.standard_normal((130, 4, 80)).astype(np.float32)
    full = attention.paged_prefill_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, qo_indptr)
    last = attention.paged_decode_attention(q[[96, 129]], kv.k, kv.v, kv.block_table, kv.seq_lens)
    np.testing.assert_allclose(full[[96, 129]], last, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_random_page_order_equals_contiguous_layout(kind, page_size):
    lens = [1, 17, 97, 300]
    paged = PagedKV(np.random.default_rng(1), lens, num_kv_heads=2, head_dim=64,
                    page_size=page_size, kind=kind)
    contiguous = PagedKV(np.random.default_rng(1), lens, num_kv_heads=2, head_dim=64,
                         page_size=page_size, kind=kind, contiguous=True)
    # Same values per logical page: copy each sequence's pages into the contiguous layout.
    for s, n in enumerate(lens):
        for p in range(-(-n // page_size)):
            contiguous.k[contiguous.block_table[s, p]] = paged.k[paged.block_table[s, p]]
            contiguous.v[contiguous.block_table[s, p]] = paged.v[paged.block_table[s, p]]
    q = np.random.default_rng(2).standard_normal((4, 8, 64)).astype(np.float32)
    a = attention.paged_decode_attention(q, paged.k, paged.v, paged.block_table, paged.seq_lens)
    b = attention.paged_decode_attention(q, contiguous.k, contiguous.v, contiguous.block_table,
                                         contiguous.seq_lens)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("products", [False, True])
def test_split_and_unsplit_plans_agree(window, products):
    """Pieces merged by log-sum-exp equal the whole. With bfloat16 products each piece rounds its
    probabilities relative to its own running max, so the two agree to bfloat16 rounding only."""
    rng = np.random.default_rng(3)
    kv = PagedKV(rng, [4099, 5, 2000], num_kv_heads=2, head_dim=128, page_size=16, kind="bfloat16")
    q = rng.standard_normal((3, 8, 128)).astype(np.float32)
    outs, splits = {}, {}
    for threads in (1, 7):
        with slots_per_thread(1 if threads == 1 else slots.SLOTS_PER_THREAD):
            plan = attention.plan_decode(kv.seq_lens, page_size=16, sliding_window=window,
                                         num_threads=threads)
        splits[threads] = len(plan.split_seqs)
        with bf16_products(products):
            outs[threads] = attention.paged_decode_attention(
                q, kv.k, kv.v, kv.block_table, kv.seq_lens, plan=plan, sliding_window=window,
                return_lse=True)
    assert splits == {1: 0, 7: splits[7]} and splits[7] > 0, "one plan whole, the other split"
    if products:
        assert relative_error(outs[7][0], outs[1][0].astype(np.float64)) <= FAST_BF16_TOLERANCE
    else:
        np.testing.assert_allclose(outs[1][0], outs[7][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[1][1], outs[7][1], rtol=1e-5, atol=1e-5)  # scores: not rounded


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
@pytest.mark.parametrize("per_thread", [1, 3, 16])
def test_attention_is_the_same_for_any_slot_count(kind, per_thread):
    """Decode and prefill with plans of 1, 3 and 16 slots per thread (more slots than sequences:
    some slots are empty) against the one-slot plan of one thread, which splits nothing."""
    rng = np.random.default_rng(5)
    kv = PagedKV(rng, [700, 1, 33, 2100], num_kv_heads=2, head_dim=64, page_size=16, kind=kind)
    q = rng.standard_normal((4, 4, 64)).astype(np.float32)
    with slots_per_thread(1):
        whole = attention.plan_decode(kv.seq_lens, page_size=16, num_threads=1)
    with slots_per_thread(per_thread):
        plan = attention.plan_decode(kv.seq_lens, page_size=16)
        prefill_q = rng.standard_normal((40, 4, 64)).astype(np.float32)
        indptr = np.array([0, 10, 11, 20, 40], np.int32)
        cut = attention.paged_prefill_attention(prefill_q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                indptr)
    assert len(whole.split_seqs) == 0
    a = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, plan=whole,
                                         fast_bf16=False)
    b = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, plan=plan,
                                         fast_bf16=False)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    with slots_per_thread(1):
        uncut = attention.paged_prefill_attention(prefill_q, kv.k, kv.v, kv.block_table,
                                                  kv.seq_lens, indptr)
    np.testing.assert_array_equal(cut, uncut)  # prefill items are never split: same sums


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(1, 16),
       st.sampled_from([1, 16, 128]))
def test_plan_covers_every_page_once_and_balances(seq_lens, threads, page_size):
    plan = attention.plan_decode(np.array(seq_lens, np.int32), page_size=page_size,
                                 num_threads=threads)
    num_slots = threads * slots.SLOTS_PER_THREAD
    assert plan.slot_indptr.shape == (num_slots + 1,)
    covered = {}
    for seq, begin, end, part in plan.items:
        covered.setdefault(seq, []).append((begin, end, part))
    assert set(covered) == set(range(len(seq_lens)))
    for seq, pieces in covered.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == -(-seq_lens[seq] // page_size)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert (len(pieces) > 1) == (pieces[0][2] >= 0)
    assert sorted(plan.split_seqs[:, 0].tolist()) == [s for s, p in covered.items() if len(p) > 1]
    assert plan.slot_indptr[0] == 0 and plan.slot_indptr[-1] == len(plan.items)
    assert np.all(np.diff(plan.slot_indptr) >= 0)
    costs = [sum(e - b + 1 for _, b, e, _ in plan.items[plan.slot_indptr[i]:plan.slot_indptr[i + 1]])
             for i in range(num_slots)]
    min_chunk = max(1, attention.MIN_SPLIT_TOKENS // page_size)
    assert max(costs) <= -(-sum(costs) // num_slots) + 2 * (min_chunk + 1)


def test_merge_states_of_two_halves_equals_the_whole():
    rng = np.random.default_rng(4)
    whole = PagedKV(rng, [200], num_kv_heads=2, head_dim=64, page_size=16, kind="float32",
                    contiguous=True)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    table = whole.block_table
    first = attention.paged_decode_attention(q, whole.k, whole.v, table, [96], return_lse=True)
    second = attention.paged_decode_attention(q, whole.k, whole.v, table[:, 6:], [104],
                                              return_lse=True)
    merged, merged_lse = attention.merge_states(first[0], first[1], second[0], second[1])
    full, full_lse = attention.paged_decode_attention(q, whole.k, whole.v, table, [200],
                                                      return_lse=True)
    np.testing.assert_allclose(merged, full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(merged_lse, full_lse, rtol=1e-6, atol=1e-5)
    twin_o, twin_lse = reference.merge_states(first[0], first[1], second[0], second[1])
    np.testing.assert_allclose(merged, twin_o, rtol=1e-5, atol=1e-6)


def test_merge_states_with_empty_parts_gives_zeros_not_nan():
    o = np.ones((2, 1, 8), np.float32)
    lse = np.array([[-np.inf], [0.0]], np.float32)
    merged, merged_lse = attention.merge_states(o, lse, o * 3, np.full((2, 1), -np.inf, np.float32))
    assert merged[0].tolist() == [[0.0] * 8] and merged_lse[0, 0] == -np.inf
    np.testing.assert_allclose(merged[1], 1.0)


def test_fully_masked_rows_give_zeros_and_no_nan():
    rng = np.random.default_rng(5)
    kv = PagedKV(rng, [0, 40], num_kv_heads=1, head_dim=64, page_size=16, kind="float32",
                 spare_pages=1)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    out, lse = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                sliding_window=3, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    expected, _ = reference.decode(q, kv.k64, kv.v64, kv.block_table, kv.seq_lens, sliding_window=3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_out_is_written_in_place():
    rng = np.random.default_rng(6)
    kv = PagedKV(rng, [33], num_kv_heads=1, head_dim=64, page_size=16, kind="bfloat16")
    q = rng.standard_normal((1, 1, 64)).astype(np.float16)
    out = np.full_like(q, np.nan)
    result = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens, out=out)
    assert result is out and not np.isnan(out).any()


def test_single_token_sequences():
    rng = np.random.default_rng(8)
    kv = PagedKV(rng, [1, 1, 1], num_kv_heads=2, head_dim=96, page_size=1, kind="float16")
    q = rng.standard_normal((3, 2, 96)).astype(np.float32)
    out = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens)
    # With one key, attention returns its value.
    for s in range(3):
        np.testing.assert_allclose(out[s], kv.v64[kv.block_table[s, 0], :, 0], rtol=1e-6)


def test_pages_past_element_2_31_are_written_and_read_where_they_are():
    """A bfloat16 cache of 2**31 + elements (4 GiB, which np.zeros maps lazily: the test touches
    a few pages): pages whose elements start past 2**31 are written, copied, gathered and attended
    over like any other — no offset in the kernels, tiles or prefetches wraps at 32 bits. One
    array serves as K and V (write_kv writes V last, so it holds the values)."""
    heads, page_size, head_dim = 8, 16, 128
    limit = 2**31 // (heads * page_size * head_dim)  # the first page starting at element 2**31
    cache = np.zeros((limit + 4, heads, page_size, head_dim), np.uint16)
    table = np.array([[limit + 3, 5, limit], [limit + 1, limit - 1, 7]], np.int32)
    lens = np.array([40, 37], np.int32)
    rng = np.random.default_rng(11)
    slots = np.concatenate([table[s, np.arange(n) // page_size].astype(np.int64) * page_size
                            + np.arange(n) % page_size for s, n in enumerate(lens)])
    values = to_storage(rng.standard_normal((len(slots), heads, head_dim)), "bfloat16")
    attention.write_kv(values, values, cache, cache, slots)
    attention.copy_pages(cache, cache, [limit + 3], [limit + 2])
    used = np.unique(np.append(table, limit + 2))
    compact = widen(cache[used], "bfloat16")  # the used pages, renumbered 0..len(used)-1
    compact_table = np.searchsorted(used, table).astype(np.int32)
    np.testing.assert_array_equal(compact[np.searchsorted(used, limit + 2)],
                                  compact[compact_table[0, 0]])
    rows, _, _ = attention.gather_kv(cache, cache, table, lens)
    np.testing.assert_array_equal(rows, values)
    # bfloat16 queries: exact on every path, the bfloat16 products' (and AMX's) included
    tolerance = (FAST_BF16_TOLERANCE if takes_fast_bf16("bfloat16", head_dim, page_size)
                 else TOLERANCE["float32"])
    q = widen(to_storage(rng.standard_normal((2, 32, head_dim)), "bfloat16"), "bfloat16")
    expected, _ = reference.decode(q, compact, compact, compact_table, lens)
    out = attention.paged_decode_attention(q.astype(np.float32), cache, cache, table, lens)
    assert relative_error(out, expected) <= tolerance
    q_rows = widen(to_storage(rng.standard_normal((10, 32, head_dim)), "bfloat16"), "bfloat16")
    indptr = np.array([0, 4, 10], np.int32)
    expected, _ = reference.prefill(q_rows, compact, compact, compact_table, lens, indptr)
    out = attention.paged_prefill_attention(q_rows.astype(np.float32), cache, cache, table, lens,
                                            indptr)
    assert relative_error(out, expected) <= tolerance
