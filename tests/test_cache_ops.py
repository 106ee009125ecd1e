"""write_kv, copy_pages and gather_kv against their NumPy twins; bad input leaves caches untouched."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_builders import PagedKV, to_storage, widen
from pagekv import InvalidPageError, attention
from pagekv.reference import attention as reference
from pagekv.reference import float8

KINDS = ["float32", "float16", "bfloat16", "float8_e4m3fn"]


def caches(kind, *, num_pages=6, heads=2, page_size=17, head_dim=80, seed=0):
    rng = np.random.default_rng(seed)
    shape = (num_pages, heads, page_size, head_dim)
    return to_storage(rng.standard_normal(shape), kind), to_storage(rng.standard_normal(shape), kind)


@given(st.sampled_from(KINDS), st.sampled_from(KINDS), st.integers(0, 2**16), st.data())
def test_write_kv_matches_reference(kind, input_kind, seed, data):
    k_cache, v_cache = caches(kind, seed=seed)
    capacity = k_cache.shape[0] * k_cache.shape[2]
    slots = data.draw(st.lists(st.integers(0, capacity - 1), unique=True, max_size=20))
    slots = np.array(slots + data.draw(st.lists(st.just(-1), max_size=3)), np.int64)
    rng = np.random.default_rng(seed + 1)
    k = to_storage(rng.standard_normal((len(slots), 2, 80)), input_kind)
    v = to_storage(rng.standard_normal((len(slots), 2, 80)), input_kind)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    # The twin stores the inputs rounded to the cache's kind, as the kernel must.
    reference.write_kv(to_storage(widen(k, input_kind), kind), to_storage(widen(v, input_kind), kind),
                       expected_k, expected_v, slots)
    view = (lambda a: a.view(np.float16)) if input_kind == "float16" else (lambda a: a)
    cache_view = (lambda a: a.view(np.float16)) if kind == "float16" else (lambda a: a)
    attention.write_kv(view(k), view(v), cache_view(k_cache), cache_view(v_cache), slots)
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)


@pytest.mark.parametrize("kind", KINDS)
def test_copy_pages_matches_reference(kind):
    k_cache, v_cache = caches(kind)
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference.copy_pages(expected_k, expected_v, [0, 3], [5, 1])
    attention.copy_pages(k_cache, v_cache, np.array([0, 3]), np.array([5, 1]))
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_kv_matches_reference(kind):
    kv = PagedKV(np.random.default_rng(2), [17, 1, 64, 0], num_kv_heads=2, head_dim=64,
                 page_size=16, kind=kind)
    k_cache = kv.k.view(np.float16) if kind == "float16" else kv.k
    k, v, indptr = attention.gather_kv(k_cache, kv.v, kv.block_table, kv.seq_lens)
    assert indptr.tolist() == [0, 17, 18, 82, 82] and k.dtype == k_cache.dtype
    for s, n in enumerate(kv.seq_lens):
        expected = reference.gather_sequence(kv.k64, kv.block_table[s], n)
        np.testing.assert_array_equal(widen(k[indptr[s]:indptr[s + 1]].view(kv.k.dtype), kind), expected)
        expected = reference.gather_sequence(kv.v64, kv.block_table[s], n)
        np.testing.assert_array_equal(widen(v[indptr[s]:indptr[s + 1]], kind), expected)


# ------------------------------------------------------------------ bad input: clear error, no change

def unchanged(k_cache, v_cache):
    before = (k_cache.copy(), v_cache.copy())
    return lambda: (np.array_equal(before[0], k_cache) and np.array_equal(before[1], v_cache))


def test_write_kv_slot_past_the_cache():
    k_cache, v_cache = caches("float32")
    same = unchanged(k_cache, v_cache)
    k = np.zeros((2, 2, 80), np.float32)
    with pytest.raises(InvalidPageError, match=r"expected slots below 102 .* got 102 at index 1"):
        attention.write_kv(k, k, k_cache, v_cache, [3, 102])
    assert same()


def test_write_kv_repeated_slot_and_wrong_shape():
    k_cache, v_cache = caches("float32")
    same = unchanged(k_cache, v_cache)
    with pytest.raises(ValueError, match="repeated slot"):
        attention.write_kv(np.zeros((2, 2, 80), np.float32), np.zeros((2, 2, 80), np.float32),
                           k_cache, v_cache, [4, 4])
    with pytest.raises(ValueError, match=r"expected k of shape \(2, 2, 80\), got \(2, 2, 64\)"):
        attention.write_kv(np.zeros((2, 2, 64), np.float32), np.zeros((2, 2, 64), np.float32),
                           k_cache, v_cache, [1, 2])
    assert same()


@pytest.mark.parametrize("src, dst, error, message", [
    ([0, 6], [1, 2], InvalidPageError, r"expected src page ids in \[0, 6\), got 6"),
    ([0], [-1], InvalidPageError, r"expected dst page ids in \[0, 6\), got -1"),
    ([0, 1], [2, 2], ValueError, "distinct and disjoint"),
    ([0, 1], [1, 2], ValueError, "distinct and disjoint"),
    ([0, 1], [2], ValueError, "one length"),
])
def test_copy_pages_bad_ids(src, dst, error, message):
    k_cache, v_cache = caches("bfloat16")
    same = unchanged(k_cache, v_cache)
    with pytest.raises(error, match=message):
        attention.copy_pages(k_cache, v_cache, src, dst)
    assert same()


def test_caches_must_match_and_be_contiguous():
    k_cache, v_cache = caches("float32")
    q = np.zeros((1, 2, 80), np.float32)
    table, lens = np.zeros((1, 1), np.int32), np.array([3], np.int32)
    with pytest.raises(ValueError, match="expected v_cache like k_cache"):
        attention.paged_decode_attention(q, k_cache, v_cache[:3], table, lens)
    with pytest.raises(ValueError, match="expected a C-contiguous k_cache"):
        attention.paged_decode_attention(q, k_cache[:, :, ::2], v_cache[:, :, ::2], table, lens)
    with pytest.raises(TypeError, match="expected float32, float16, bfloat16 or float8_e4m3fn"):
        attention.paged_decode_attention(q, k_cache.astype(np.float64), v_cache.astype(np.float64),
                                         table, lens)
    with pytest.raises(TypeError, match="expected float32, float16, bfloat16 or float8_e4m3fn .* got int8"):
        attention.paged_decode_attention(q, k_cache.astype(np.int8), v_cache.astype(np.int8), table, lens)
    with pytest.raises(ValueError, match=r"expected v_cache like k_cache \(float8_e4m3fn .*got bfloat16"):
        attention.paged_decode_attention(q, k_cache.astype(np.uint8), v_cache.astype(np.uint16), table,
                                         lens)
    with pytest.raises(TypeError, match=r"expected float32, float16 or bfloat16 \(or uint16 .* got uint8"):
        attention.paged_decode_attention(q.astype(np.uint8), k_cache.astype(np.uint8),
                                         v_cache.astype(np.uint8), table, lens)  # no float8 queries
    with pytest.raises(ValueError, match=r"expected k_cache of shape \[num_pages"):
        attention.paged_decode_attention(q, k_cache[0], v_cache[0], table, lens)


def test_write_kv_into_float8_saturates_and_lands_alike_in_every_caller_type():
    """Beyond +-448 (infinities too) a float8 E4M3 cache holds +-448, NaN stays NaN; uint8 bits,
    an ml_dtypes.float8_e4m3fn array and a torch float8_e4m3fn tensor receive the same bytes."""
    k = np.array([[[1e6, -np.inf, np.inf, np.nan, -0.0, 0.3, 449.0, -464.5]]], np.float32)
    v = -k
    k_bits, v_bits = np.zeros((1, 1, 1, 8), np.uint8), np.zeros((1, 1, 1, 8), np.uint8)
    attention.write_kv(k, v, k_bits, v_bits, [0])
    assert k_bits[0, 0, 0].tolist() == [0x7E, 0xFE, 0x7E, 0x7F, 0x80, float8.encode(0.3), 0x7E, 0xFE]
    np.testing.assert_array_equal(v_bits[0, 0, 0, [0, 1, 2, 6, 7]], [0xFE, 0x7E, 0xFE, 0xFE, 0x7E])
    ml_dtypes = pytest.importorskip("ml_dtypes")
    k_ml, v_ml = (np.zeros((1, 1, 1, 8), ml_dtypes.float8_e4m3fn) for _ in range(2))
    attention.write_kv(k, v, k_ml, v_ml, [0])
    np.testing.assert_array_equal(k_ml.view(np.uint8), k_bits)
    torch = pytest.importorskip("torch")
    k_t, v_t = (torch.zeros((1, 1, 1, 8), dtype=torch.float8_e4m3fn) for _ in range(2))
    attention.write_kv(torch.from_numpy(k), torch.from_numpy(v), k_t, v_t, [0])
    np.testing.assert_array_equal(k_t.view(torch.uint8).numpy(), k_bits)
    np.testing.assert_array_equal(v_t.view(torch.uint8).numpy(), v_bits)


@pytest.mark.parametrize("kind", ["float8_e4m3fn", "bfloat16", "float32"])
def test_write_kv_with_scales_stores_the_values_divided_by_them(kind):
    """k / k_scale and v / v_scale, divided in float32 and then rounded: with a scale of 4, keys
    up to 1,792 fit a float8 cache's +-448 instead of saturating."""
    k_cache, v_cache = caches(kind)
    rng = np.random.default_rng(9)
    k = (rng.standard_normal((3, 2, 80)) * 1000).astype(np.float32)
    v = rng.standard_normal((3, 2, 80)).astype(np.float32)
    slots = np.array([5, 40, -1])
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    reference.write_kv(to_storage(k / np.float32(4.0), kind), to_storage(v / np.float32(0.5), kind),
                       expected_k, expected_v, slots)
    attention.write_kv(k, v, k_cache, v_cache, slots, k_scale=4.0, v_scale=0.5)
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)
    assert np.abs(widen(k_cache[0, :, 5], kind)).max() > 100  # k / 4, not clipped at 448 / 4


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad, error, message", [
    (0.0, ValueError, "None or a number > 0 within float32's range, got 0.0"),
    (-2.0, ValueError, "got -2.0"),
    (float("nan"), ValueError, "got nan"),
    (float("inf"), ValueError, "got inf"),
    (1e39, ValueError, "got 1e[+]?39"),
    ("2", TypeError, "a real number, got '2'"),
    (True, TypeError, "a real number, got True"),
])
def test_bad_scales_are_refused_and_nothing_is_written(name, bad, error, message):
    k_cache, v_cache = caches("float8_e4m3fn")
    before = k_cache.copy(), v_cache.copy()
    new = np.ones((1, 2, 80), np.float32)
    with pytest.raises(error, match=f"expected {name} .*" + message):
        attention.write_kv(new, new, k_cache, v_cache, [3], **{name: bad})
    np.testing.assert_array_equal(k_cache, before[0])
    np.testing.assert_array_equal(v_cache, before[1])
