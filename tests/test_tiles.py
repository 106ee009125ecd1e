"""The register tiles (pagekv.kernels._score_tiles, _value_tiles) against float64 on exact inputs.

The tiles multiply bfloat16 numbers exactly and sum in float32, so on bfloat16 inputs they must
match float64 to float32 summation error: any wrong lane, pair or row shows up as a large error.
"""

import functools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from kv_builders import bf16_products, to_storage, widen
from pagekv import attention
from pagekv.kernels import _tile_ir as tile_ir
from pagekv.kernels._key_lanes import KEY_LANE_TILES
from pagekv.kernels._score_tiles import EIGHT_KEYS, SCORE_TILES, _score_order
from pagekv.kernels._tile_rows import pack_pairs, pair_dim, pair_position, value_dim
from pagekv.kernels._value_tiles import EIGHT_ROWS_CHUNK, VALUE_TILES

ROWS = (4, 3, 2, 1)  # query rows (accumulator rows) of the tiles the page loops take


PAIRED, PAIRED_FLOAT8 = tile_ir.PAIRED, tile_ir.PAIRED_FLOAT8
# The vdpbf16ps storages, and the dtype of the rows each multiplies (bfloat16 queries for both).
PAIRED_ROWS = {PAIRED: "bfloat16", PAIRED_FLOAT8: "float8_e4m3fn"}


def _scores_harness(tokens, storage):
    """A fresh (uncached) function that runs one query-key tile for keys of ``storage``: compiled
    on its first call, so it takes whatever code generation the tiles choose at that moment.
    16-bit keys are passed as their bits (uint16): the tile reads them through their address."""
    four_keys, one_key = SCORE_TILES[storage]
    tile = {8: EIGHT_KEYS.get(storage), 4: four_keys, 1: one_key}[tokens]

    @njit
    def run(q, k, scale, out, pf):
        tile(q.shape[0], q.ctypes.data, q.strides[0], k.ctypes.data, k.strides[0], k.shape[1],
             scale, out.ctypes.data, out.strides[0], pf, pf)
    return run


def _values_harness(storage):
    """Runs one value tile for value rows of ``storage``, compiled on first call: float32
    probabilities, or packed pairs of them for the vdpbf16ps storages."""
    tile = VALUE_TILES[storage]

    @njit
    def run(acc, v, probs, num_tokens, pf):
        tile(acc.shape[0], acc.ctypes.data, acc.strides[0], v.ctypes.data, v.strides[0],
             probs.ctypes.data, probs.strides[0], num_tokens, v.shape[1], pf, pf)
    return run


def _key_lanes_harness(storage):
    """Runs prefill's key-lane tile of ``storage`` (16 key rows, any number of query rows),
    compiled on first call as :func:`_scores_harness`."""
    tile = KEY_LANE_TILES[storage]

    @njit
    def run(q, k, scale, out, pf):
        tile(q.shape[0], q.ctypes.data, q.strides[0], k.ctypes.data, k.strides[0], q.shape[1], scale,
             out.ctypes.data, out.strides[0], pf, pf)
    return run


def _chunk_values_harness(storage):
    """Runs prefill's 8-row value tile over a chunk of blocks (EIGHT_ROWS_CHUNK) of ``storage``,
    compiled on first call."""
    tile = EIGHT_ROWS_CHUNK[storage]

    @njit
    def run(acc, blocks, aheads, block_tokens, last_tokens, v_row, packed, head_dim):
        tile(8, acc.ctypes.data, acc.strides[0], blocks.ctypes.data, aheads, blocks.shape[0],
             block_tokens, last_tokens, v_row, packed.ctypes.data, packed.strides[0], head_dim)
    return run


_scores, _values = functools.cache(_scores_harness), functools.cache(_values_harness)
_key_lanes, _chunk_values = functools.cache(_key_lanes_harness), functools.cache(_chunk_values_harness)


@njit
def _pack(p, num_cols, packed):
    pack_pairs(p, 0, p.shape[0], num_cols, packed)


def _value_order(head_dim):
    """int64 [head_dim]: the dimension that each position of a bfloat16 value tile's
    accumulator row holds."""
    return np.array([value_dim(j, head_dim) for j in range(head_dim)])


def _bf16(rng, shape):
    return to_storage(rng.standard_normal(shape), "bfloat16")


def _nan_padded_rows(rng, num_rows, filled, head_dim, storage="bfloat16"):
    """num_rows rows of ``storage`` (float32, float16, bfloat16 or float8 bits) whose first ``filled`` rows
    hold random values and whose other rows, and the 16 elements after each row, hold NaN (what a
    page's unused rows may hold): a tile that reads past them turns its result NaN. Returns (the
    rows as their bits, their float64 values, NaN where not filled)."""
    values = np.full((num_rows, head_dim + 16), np.nan)
    values[:filled, :head_dim] = rng.standard_normal((filled, head_dim))
    stored = to_storage(values, storage)[:, :head_dim]
    bits = {"float32": np.uint32, "float8_e4m3fn": np.uint8}.get(storage, np.uint16)
    return stored.view(bits), widen(stored, storage)


@given(st.sampled_from(ROWS), st.sampled_from([8, 4, 1]),
       st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128, 256]), st.floats(0.01, 2.0),
       st.integers(0, 2**16), st.booleans(), st.sampled_from(list(PAIRED_ROWS)))
def test_query_key_tiles_match_float64(rows, tokens, head_dim, scale, seed, prefetch, storage):
    """bfloat16 queries against bfloat16 or float8 key rows (turned into bfloat16 as they are
    loaded), followed by NaN: any read past a row, and any wrong lane, shows."""
    rng = np.random.default_rng(seed)
    q = _bf16(rng, (rows, head_dim))
    k, k64 = _nan_padded_rows(rng, tokens, tokens, head_dim, PAIRED_ROWS[storage])
    out = np.full((rows, 12), np.nan, np.float32)  # wider than the tile: columns past it stay NaN
    _scores(tokens, storage)(q, k, np.float32(scale), out, k.ctypes.data if prefetch else 0)
    expected = widen(q, "bfloat16") @ k64.T * np.float64(np.float32(scale))
    np.testing.assert_allclose(out[:, :tokens], expected, rtol=1e-5, atol=1e-5 * head_dim)
    assert np.isnan(out[:, tokens:]).all()


@given(st.sampled_from([1, 2, 3, 8, 15, 16, 17, 24, 31, 32, 33, 64, 97]),
       st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128, 256]), st.floats(0.01, 2.0),
       st.integers(0, 2**16), st.booleans(),
       st.sampled_from([PAIRED, PAIRED_FLOAT8, "float32", "float16", "bfloat16", "float8_e4m3fn"]))
def test_key_lane_tiles_match_float64(rows, head_dim, scale, seed, prefetch, storage):
    """The key-lane tiles (kernels/_key_lanes.py) on rows in tiles of 16 and a rest of 8, 4, 2 and
    1, every head_dim chunk count with and without a last 16 dims: bfloat16 queries and bfloat16
    or float8 keys by vdpbf16ps, or float32 queries and keys of each FMA storage. Query and key
    rows are followed by NaN, so a read past head_dim shows."""
    rng = np.random.default_rng(seed)
    paired = storage in PAIRED_ROWS
    q, q64 = _nan_padded_rows(rng, rows, rows, head_dim, "bfloat16" if paired else "float32")
    k, k64 = _nan_padded_rows(rng, 16, 16, head_dim, PAIRED_ROWS.get(storage, storage))
    out = np.full((rows, 20), np.nan, np.float32)  # wider than the tile: columns past it stay NaN
    _key_lanes(storage)(q, k, np.float32(scale), out, k.ctypes.data if prefetch else 0)
    expected = q64 @ k64.T * np.float64(np.float32(scale))
    np.testing.assert_allclose(out[:, :16], expected, rtol=1e-5, atol=1e-5 * head_dim)
    assert np.isnan(out[:, 16:]).all()


FMA_STORAGE = ["float32", "float16", "bfloat16", "float8_e4m3fn"]


def _tile_order(storage, head_dim):
    """int64 [head_dim]: the dimension each position of an FMA tile's query and accumulator rows
    holds: pair order for bfloat16 rows where PAIR_ORDER is on (as it is when the tile compiles),
    else the natural order."""
    if storage == "bfloat16" and tile_ir.PAIR_ORDER:
        return np.array([pair_dim(j) for j in range(head_dim)])
    return np.arange(head_dim)


def _check_fma_scores(run, rng, rows, tokens, head_dim, storage, scale, prefetch):
    """An FMA score tile (compiled ``run``) on float32 queries (in the tile's order) and NaN-padded
    key rows of ``storage`` against float64; the output columns past the tile's stay NaN."""
    q = rng.standard_normal((rows, head_dim)).astype(np.float32)
    k, k64 = _nan_padded_rows(rng, tokens, tokens, head_dim, storage)
    out = np.full((rows, 12), np.nan, np.float32)
    tile_q = np.ascontiguousarray(q[:, _tile_order(storage, head_dim)])
    run(tile_q, k, np.float32(scale), out, k.ctypes.data if prefetch else 0)
    expected = q.astype(np.float64) @ k64.T * np.float64(np.float32(scale))
    np.testing.assert_allclose(out[:, :tokens], expected, rtol=1e-5, atol=1e-5 * head_dim)
    assert np.isnan(out[:, tokens:]).all()


def _check_fma_values(run, rng, rows, head_dim, num_tokens, storage):
    """An FMA value tile (compiled ``run``) over num_tokens rows of a 16-row NaN-padded page of
    ``storage``, the probabilities past num_tokens NaN, against float64."""
    v, v64 = _nan_padded_rows(rng, 16, num_tokens, head_dim, storage)
    p = np.full((rows, 16), np.nan, np.float32)
    p[:, :num_tokens] = rng.random((rows, num_tokens))
    acc = rng.standard_normal((rows, head_dim)).astype(np.float32)
    expected = acc.astype(np.float64) + p[:, :num_tokens].astype(np.float64) @ v64[:num_tokens]
    order = _tile_order(storage, head_dim)
    tile_acc = np.ascontiguousarray(acc[:, order])
    run(tile_acc, v, p, num_tokens, v.ctypes.data)
    np.testing.assert_allclose(tile_acc, expected[:, order], rtol=1e-5, atol=1e-5)


@given(st.sampled_from(ROWS), st.sampled_from([4, 1]),
       st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128, 256]), st.floats(0.01, 2.0),
       st.integers(0, 2**16), st.booleans(), st.sampled_from(FMA_STORAGE))
def test_fma_query_key_tiles_match_float64(rows, tokens, head_dim, scale, seed, prefetch, storage):
    """float32 queries against float32, float16, bfloat16 or float8 keys (widened as the tile loads
    them)."""
    _check_fma_scores(_scores(tokens, storage), np.random.default_rng(seed), rows, tokens, head_dim,
                      storage, scale, prefetch)


@given(st.sampled_from(ROWS), st.sampled_from([16, 48, 64, 80, 128, 256, 272, 288]),
       st.integers(1, 16),
       st.integers(0, 2**16), st.sampled_from(list(PAIRED_ROWS)))
def test_value_tiles_match_float64_and_skip_stale_rows(rows, head_dim, num_tokens, seed, storage):
    """acc += p @ v over num_tokens bfloat16 or float8 rows of a 16-row page whose other rows (and
    the gaps after each row) hold NaN; an odd last token is taken alone (its partner row is never
    multiplied, even by a zero). head_dim past 256 takes the one-row tile's other walk (chunks
    outer)."""
    rng = np.random.default_rng(seed)
    v, v64 = _nan_padded_rows(rng, 16, num_tokens, head_dim, PAIRED_ROWS[storage])
    p = rng.random((rows, 16)).astype(np.float32)
    packed = np.zeros((rows, 9), np.uint32)
    _pack(p, num_tokens, packed)
    acc = rng.standard_normal((rows, head_dim)).astype(np.float32)
    rounded = widen(to_storage(p, "bfloat16"), "bfloat16")[:, :num_tokens]
    expected = acc + rounded @ v64[:num_tokens]
    order = _value_order(head_dim)  # the tile keeps dimension order[j] at position j
    tile_acc = acc[:, order].copy()
    _values(storage)(tile_acc, v, packed, num_tokens, v.ctypes.data)
    np.testing.assert_allclose(tile_acc, expected[:, order], rtol=1e-5, atol=1e-5)


@given(st.sampled_from([16, 48, 80, 128, 256]), st.integers(1, 5), st.sampled_from([2, 16, 18]),
       st.data(), st.integers(0, 2**16), st.booleans(), st.sampled_from(list(PAIRED_ROWS)))
def test_chunk_value_tile_matches_float64_over_scattered_blocks(head_dim, num_blocks, block_tokens,
                                                                data, seed, prefetch, storage):
    """Prefill's 8-row value tile over a chunk of blocks (EIGHT_ROWS_CHUNK), each a separate array
    (scattered in memory), block_tokens rows each but the last (1 .. block_tokens, odd or even);
    rows past each block's tokens and the gaps after each row NaN; the probabilities one packed
    run over the chunk."""
    rng = np.random.default_rng(seed)
    last_tokens = data.draw(st.integers(1, block_tokens))
    counts = [block_tokens] * (num_blocks - 1) + [last_tokens]
    pages = [_nan_padded_rows(rng, block_tokens, n, head_dim, PAIRED_ROWS[storage]) for n in counts]
    blocks = np.array([bits.ctypes.data for bits, _ in pages], np.int64)
    values64 = np.concatenate([values[:n] for (_, values), n in zip(pages, counts)])
    num_cols = sum(counts)
    p = rng.random((8, num_cols)).astype(np.float32)
    packed = np.zeros((8, num_cols // 2 + 1), np.uint32)
    _pack(p, num_cols, packed)
    acc = rng.standard_normal((8, head_dim)).astype(np.float32)
    expected = acc + widen(to_storage(p, "bfloat16"), "bfloat16") @ values64
    positions = _value_order(head_dim)
    tile_acc = acc[:, positions].copy()
    aheads = blocks[::-1].copy()  # other blocks of the chunk: prefetching never changes a result
    _chunk_values(storage)(tile_acc, blocks, aheads.ctypes.data if prefetch else 0, block_tokens,
                           last_tokens, pages[0][0].strides[0], packed, head_dim)
    np.testing.assert_allclose(tile_acc, expected[:, positions], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 48, 80, 128, 272])
def test_pair_order_is_each_blocks_evens_then_odds(head_dim):
    order = np.array([pair_dim(j) for j in range(head_dim)])
    evens_then_odds = np.array([0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15])
    for block in range(head_dim // 16):
        np.testing.assert_array_equal(order[16 * block:16 * block + 16], evens_then_odds + 16 * block)
    positions = np.array([pair_position(d) for d in range(head_dim)])
    np.testing.assert_array_equal(order[positions], np.arange(head_dim))  # its inverse


@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128, 272])
def test_value_order_is_a_permutation_of_whole_chunks(head_dim):
    """Each 32 positions hold their own 32 dimensions (the last 16 their own 16), so a row's
    dimensions can be put back in order, and only within a chunk."""
    order = _value_order(head_dim)
    np.testing.assert_array_equal(np.sort(order), np.arange(head_dim))
    np.testing.assert_array_equal(order // 32, np.arange(head_dim) // 32)
    first_16 = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27] if head_dim >= 32 else \
        [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # vpunpcklwd's, vpunpckhwd's
    assert list(order[:16]) == first_16


@given(st.sampled_from(ROWS), st.sampled_from([16, 48, 64, 80, 96, 112, 128, 256, 272]),
       st.integers(1, 16), st.integers(0, 2**16), st.sampled_from(FMA_STORAGE))
def test_fma_value_tiles_match_float64_and_skip_stale_rows(rows, head_dim, num_tokens, seed, storage):
    """acc += p @ v over num_tokens float32, float16, bfloat16 or float8 rows of a 16-row page
    whose other rows, the gaps after each row and the probabilities past num_tokens hold NaN;
    head_dim 80-112 and 272 end in a pass of 1-3 chunks."""
    _check_fma_values(_values(storage), np.random.default_rng(seed), rows, head_dim, num_tokens,
                      storage)


@given(st.lists(st.floats(-2.0**100, 2.0**100, width=32), min_size=1, max_size=40))
def test_rounding_and_packing_match_round_to_nearest_even(values):
    p = np.array([values], np.float32)
    packed = np.full((1, 21), 0xDEADBEEF, np.uint32)
    _pack(p, p.shape[1], packed)
    expected = to_storage(p, "bfloat16")[0]
    halves = packed[0, :(p.shape[1] + 1) // 2].view(np.uint16)  # little-endian: low half first
    np.testing.assert_array_equal(halves[:p.shape[1]], expected)
    if p.shape[1] % 2:
        assert halves[p.shape[1]] == 0  # the missing partner of an odd last column is 0


def test_portable_code_gives_the_instructions_results(monkeypatch):
    """Compiled for a CPU without AVX512-BF16, the tiles must give the same results, so a kernel
    behaves alike everywhere (subnormals aside). Skipped where the instruction is missing: then
    the portable code is all there is, and the other tests check it against float64."""
    if not tile_ir.HAS_AVX512_BF16:
        pytest.skip("this CPU has no AVX512-BF16")
    rng = np.random.default_rng(5)
    q, k = _bf16(rng, (4, 128)), _bf16(rng, (8, 128))
    v = _bf16(rng, (16, 128))
    packed = np.zeros((4, 9), np.uint32)
    _pack(rng.random((4, 16)).astype(np.float32), 15, packed)
    acc0 = rng.standard_normal((4, 128)).astype(np.float32)
    results = []
    for native in (True, False):
        monkeypatch.setattr(tile_ir, "HAS_AVX512_BF16", native)
        values = _values_harness(PAIRED)  # compiled now, as the score tiles below
        outs = {tokens: np.zeros((4, tokens), np.float32) for tokens in (8, 4)}
        for tokens, out in outs.items():
            _scores_harness(tokens, PAIRED)(q, k[:tokens], np.float32(0.125), out, 0)
        key_lanes = np.zeros((4, 16), np.float32)
        _key_lanes_harness(PAIRED)(q, v, np.float32(0.125), key_lanes, 0)
        acc = acc0.copy()
        values(acc, v, packed, 15, 0)
        results.append((outs[8], outs[4], key_lanes, acc))
    for native, portable in zip(*results):
        np.testing.assert_array_equal(native, portable)


def _e4m3_words_harness(width, picks):
    """Runs e4m3_words on the 64 // width rows of ``width`` bytes at the start of a byte run,
    storing the vectors ``picks`` asks for one after another; compiled on first call, so it
    takes the conversion chosen at that moment."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def words_of(typingctx, source, destination):
        def codegen(context, builder, signature, args):
            rows = [builder.add(args[0], ir.Constant(tile_ir.I64, i * width))
                    for i in range(64 // width)]
            for i, words in enumerate(tile_ir.e4m3_words(builder, rows, width, picks)):
                address = builder.add(args[1], ir.Constant(tile_ir.I64, 64 * i))
                builder.store(words, builder.inttoptr(address, words.type.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.void(types.intp, types.intp), codegen

    @njit
    def run(source, out):
        words_of(source.ctypes.data, out.ctypes.data)
    return run


@pytest.mark.parametrize("vbmi", [True, False])
@pytest.mark.parametrize("width", [32, 16])
def test_float8_to_bfloat16_is_exact_for_every_byte(monkeypatch, vbmi, width):
    """Every E4M3 byte (subnormals, zeros, the largest, NaN) becomes the bfloat16 of its value,
    by the table lookups (AVX512-VBMI; only where the CPU has it) and by the portable form; the
    picks put each row's words where asked, and None picks give zero words."""
    if vbmi and not tile_ir.HAS_AVX512_VBMI:
        pytest.skip("this CPU has no AVX512-VBMI")
    monkeypatch.setattr(tile_ir, "HAS_AVX512_VBMI", vbmi)
    from pagekv.reference import float8

    rows = 64 // width
    picks = [[i * width + d if d < width else None for d in range(32)] for i in range(rows)]
    picks.append(list(range(63, 31, -1)))  # the second half of the run, backwards
    run_words = _e4m3_words_harness(width, picks)
    for start in range(0, 256, 64):
        run = np.arange(start, start + 64, dtype=np.uint8)
        out = np.zeros((len(picks), 32), np.uint16)
        run_words(run, out)
        values = float8.decode(run)
        expected = to_storage(values, "bfloat16")  # exact: E4M3 numbers are bfloat16 numbers
        for words, pick in zip(out, picks):
            got = widen(words, "bfloat16")
            want = np.array([values[p] if p is not None else 0.0 for p in pick])
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            finite = ~np.isnan(want)
            np.testing.assert_array_equal(got[finite], want[finite])
            want_bits = np.array([expected[p] if p is not None else 0 for p in pick], np.uint16)
            np.testing.assert_array_equal(words[finite], want_bits[finite])  # -0 too


def test_fast_bf16_must_be_a_bool():
    rng = np.random.default_rng(0)
    cache = _bf16(rng, (2, 1, 16, 64))
    q = np.ones((1, 1, 64), np.float32)
    table, lens = np.array([[1]], np.int32), np.array([5], np.int32)
    with pytest.raises(ValueError, match="expected fast_bf16 a bool, got 'yes'"):
        attention.paged_decode_attention(q, cache, cache, table, lens, fast_bf16="yes")
    with pytest.raises(ValueError, match="expected fast_bf16 a bool, got 1"):
        attention.paged_prefill_attention(q, cache, cache, table, lens, np.array([0, 1], np.int32),
                                          fast_bf16=1)


def _bf16_problem(seed):
    rng = np.random.default_rng(seed)
    k, v = _bf16(rng, (8, 2, 16, 128)), _bf16(rng, (8, 2, 16, 128))
    q = widen(_bf16(rng, (2, 8, 128)), "bfloat16").astype(np.float32)  # bfloat16 values
    table, lens = rng.permutation(8).astype(np.int32).reshape(2, 4), np.array([64, 37], np.int32)
    return q, k, v, table, lens


def test_fast_bf16_keeps_a_bfloat16_query_exact():
    """A bfloat16 query is not rounded (the scale multiplies the sums), so scores and lse match
    the float32 path's to float32 rounding; only the output carries the probabilities' rounding.
    Run on every CPU: the bfloat16 tiles' portable form where AVX512-BF16 is missing."""
    q, k, v, table, lens = _bf16_problem(9)
    with bf16_products(True):
        fast, fast_lse = attention.paged_decode_attention(q, k, v, table, lens, return_lse=True)
        exact, exact_lse = attention.paged_decode_attention(q, k, v, table, lens, return_lse=True,
                                                            fast_bf16=False)
    np.testing.assert_allclose(fast_lse, exact_lse, rtol=1e-6, atol=1e-6)
    assert 0 < np.abs(fast - exact).max() <= 5e-3 * np.abs(exact).max()


def test_without_bf16_products_fast_bf16_is_the_float32_path():
    """Where the CPU has no bfloat16 products, fast_bf16 rounds nothing: decode and prefill give
    the float32 products' results, bit for bit."""
    q, k, v, table, lens = _bf16_problem(10)
    rows = np.ascontiguousarray(np.repeat(q, 3, axis=0)[:5])
    indptr = np.array([0, 2, 5], np.int32)
    with bf16_products(False):
        for fast_bf16 in (True, False):
            decode = attention.paged_decode_attention(q, k, v, table, lens, fast_bf16=fast_bf16)
            prefill = attention.paged_prefill_attention(rows, k, v, table, lens, indptr,
                                                        fast_bf16=fast_bf16)
            if fast_bf16:
                fast = decode, prefill
    np.testing.assert_array_equal(fast[0], decode)
    np.testing.assert_array_equal(fast[1], prefill)


def _lane_sum_tree(count):
    """The lanes where lane_sums leaves the sums of ``count`` vectors, and the shuffle masks it
    emits (built into a throwaway LLVM function)."""
    from llvmlite import ir

    vector = ir.VectorType(ir.FloatType(), tile_ir.LANES)
    function = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), [vector] * count), "tree")
    builder = ir.IRBuilder(function.append_basic_block())
    _, lane_of = tile_ir.lane_sums(builder, list(function.args))
    masks = [i.operands[2] for i in function.blocks[0].instructions if i.opname == "shufflevector"]
    return lane_of, masks


def test_lane_sum_tree_leaves_each_input_where_its_docstring_says():
    """Input p of 16 ends in lane 4 * (p % 4) + p // 4: the order _score_order relies on to
    store each row of a 4 x 4 score tile straight from one 128-bit lane."""
    lane_of, masks = _lane_sum_tree(16)
    assert lane_of == {p: 4 * (p % 4) + p // 4 for p in range(16)}
    assert len(masks) == 30  # 15 merges of two shuffles
    order = _score_order(4, 4)
    for r in range(4):  # row r's scores, in token order, fill lanes 4r .. 4r + 3
        assert [lane_of[order.index(r * 4 + t)] for t in range(4)] == [4 * r + t for t in range(4)]


@pytest.mark.parametrize("block", [16, 8, 4, 2])
def test_every_merge_adds_two_lanes_of_one_block(block):
    """Each lane of a merge adds two lanes of the same block of x (or of y), and the merge keeps
    every lane of both: a mask that mixed blocks would add two different dot products."""
    low, high = tile_ir._merge_masks(block)
    assert sorted(low + high) == list(range(2 * tile_ir.LANES))
    for a, b in zip(low, high):
        assert a // block == b // block


@pytest.mark.parametrize("accumulators", [4, 16])  # AVX2's register budget, AVX-512's
@pytest.mark.parametrize("storage, pair_order", [(storage, False) for storage in FMA_STORAGE]
                         + [("bfloat16", True)])
def test_fma_tiles_match_float64_with_either_register_budget(monkeypatch, accumulators, storage,
                                                             pair_order):
    """The FMA tiles take their shape from ACCUMULATORS when they compile: with 16 a 4 x 4 score
    tile and 4-chunk value passes, with 4 two key rows per accumulator (8 dimensions each; a
    one-row tile one key each, summed by four_sums) and fewer chunks per pass; bfloat16 rows in
    pair order or not (PAIR_ORDER). Every combination must compute the same scores and sums,
    whatever the CPU."""
    monkeypatch.setattr(tile_ir, "ACCUMULATORS", accumulators)
    monkeypatch.setattr(tile_ir, "PAIR_ORDER", pair_order)
    rng = np.random.default_rng(accumulators)
    runs = {tokens: _scores_harness(tokens, storage) for tokens in (4, 1)}  # compiled now
    values = _values_harness(storage)
    for rows in ROWS:
        for head_dim in (16, 80, 128, 256):
            for tokens, run in runs.items():
                _check_fma_scores(run, rng, rows, tokens, head_dim, storage, 0.5, True)
            _check_fma_values(values, rng, rows, head_dim, 13, storage)


@pytest.mark.parametrize("kind, page_size, head_dim, products, expected", [
    ("bfloat16", 16, 128, True, PAIRED),
    ("bfloat16", 2, 80, True, PAIRED),
    ("bfloat16", 17, 128, True, "bfloat16"),   # odd page size: no packed pairs
    ("bfloat16", 16, 72, True, "bfloat16"),    # head_dim not a multiple of 16 (Numba's loops)
    ("bfloat16", 16, 128, False, "bfloat16"),  # no bfloat16 products, or fast_bf16=False
    ("float8_e4m3fn", 16, 128, True, PAIRED_FLOAT8),
    ("float8_e4m3fn", 2, 80, True, PAIRED_FLOAT8),
    ("float8_e4m3fn", 17, 128, True, "float8_e4m3fn"),
    ("float8_e4m3fn", 16, 72, True, "float8_e4m3fn"),
    ("float8_e4m3fn", 16, 128, False, "float8_e4m3fn"),
    ("float16", 16, 128, True, "float16"),
    ("float32", 16, 128, True, "float32"),
])
def test_kernel_kind_takes_the_paired_tiles_only_where_they_apply(kind, page_size, head_dim,
                                                                  products, expected):
    from pagekv import _arrays
    from pagekv.kernels.page_loops import kernel_kind

    storage = {"float32": np.float32, "float8_e4m3fn": np.uint8}.get(kind, np.uint16)
    cache = np.zeros((1, 1, page_size, head_dim), storage)
    assert kernel_kind(cache, _arrays.KV_FORMAT[kind], products) == expected


@pytest.mark.parametrize("near_into_l1", [True, False])
@pytest.mark.parametrize("storage", [PAIRED, "float32"])
def test_near_prefetch_goes_where_near_into_l1_says(monkeypatch, near_into_l1, storage):
    """The tiles' second, near prefetch is prefetcht0 (LLVM locality 3) with NEAR_INTO_L1, else
    prefetcht1 (locality 2) like the far one (AMD Zen 4: kernels/prefetch.py); a hint either way,
    so the scores and sums do not change."""
    from pagekv.kernels import prefetch

    monkeypatch.setattr(prefetch, "NEAR_INTO_L1", near_into_l1)
    rng = np.random.default_rng(7)
    scores, values = _scores_harness(4, storage), _values_harness(storage)  # compiled now
    if storage == PAIRED:
        q = _bf16(rng, (4, 64))
        k, k64 = _nan_padded_rows(rng, 4, 4, 64)
        out = np.zeros((4, 16), np.float32)
        scores(q, k, np.float32(1.0), out, k.ctypes.data)
        np.testing.assert_allclose(out[:, :4], widen(q, "bfloat16") @ k64.T, rtol=1e-5, atol=1e-3)
    else:
        _check_fma_scores(scores, rng, 4, 4, 64, storage, 1.0, True)
        _check_fma_values(values, rng, 4, 64, 13, storage)
    ir = "".join(scores.inspect_llvm().values())
    localities = set(re.findall(r"@llvm\.prefetch[.\w]*\([^)]*i32 0, i32 (\d), i32 1\)", ir))
    assert localities == ({"2", "3"} if near_into_l1 else {"2"})
