"""Every implementation in the attention benchmark computes the same attention (on a small shape)."""

import importlib.util

import numpy as np
import pytest

from attention_cases import (KINDS, as_float32, numpy_gather_decode, pagekv_decode, pagekv_prefill,
                             prefill_flops, prefill_queries, problem, streaming_read, torch_sdpa_decode,
                             torch_sdpa_prefill)
from fma_peak import CHAINS, _dot_pairs_on_every_thread, _on_every_thread
from pagekv import attention
from pagekv.reference import attention as reference
from visit_order import visit_order_sum


@pytest.mark.parametrize("kind", KINDS)
def test_implementations_agree(kind):
    p = problem("tiny", kind)
    expected = numpy_gather_decode(p)()
    variants = (pagekv_decode(p), pagekv_decode(p, prefetch=False), pagekv_decode(p, contiguous=True))
    for run in variants:
        if kind == "bfloat16":  # fast_bf16: query and probabilities rounded to bfloat16
            assert np.abs(run() - expected).max() <= 5e-3 * np.abs(expected).max()
        else:
            np.testing.assert_allclose(run(), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(pagekv_decode(p, fast_bf16=False)(), expected, rtol=1e-4, atol=1e-5)
    if importlib.util.find_spec("torch") is not None:
        got = torch_sdpa_decode(p)().float().squeeze(2).numpy()
        np.testing.assert_allclose(got, expected, rtol=0.05 if kind == "bfloat16" else 1e-4, atol=2e-2)


def test_float16_case_matches_reference():
    """The float16 decode case (pagekv alone) computes attention over the pages it was given."""
    p = problem("tiny", "float16")
    assert p.k_cache.dtype == np.float16
    expected, _ = reference.decode(p.q.astype(np.float64), as_float32(p.k_cache, "float16"),
                                   as_float32(p.v_cache, "float16"), p.block_table, p.seq_lens)
    for contiguous in (False, True):
        np.testing.assert_allclose(pagekv_decode(p, contiguous=contiguous)(), expected, rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_implementations_agree(kind):
    p = problem("tiny", kind)
    q_len = 17  # of 100 tokens: the chunk starts and ends mid-page
    rows, qo_indptr = prefill_queries(p, q_len)
    expected, _ = reference.prefill(rows, as_float32(p.k_cache, kind), as_float32(p.v_cache, kind),
                                    p.block_table, p.seq_lens, qo_indptr)
    tolerance = dict(rtol=0.05, atol=2e-2) if kind == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
    for contiguous in (False, True):
        np.testing.assert_allclose(pagekv_prefill(p, contiguous=contiguous, q_len=q_len)(), expected,
                                   **tolerance)
    if importlib.util.find_spec("torch") is not None:
        got = torch_sdpa_prefill(p, q_len)().float().transpose(1, 2).reshape(rows.shape).numpy()
        np.testing.assert_allclose(got, expected, **tolerance)


def test_prefill_flops_count_every_visible_key():
    p = problem("tiny", "float32")
    q_len = 17
    visible = sum((np.arange(n - q_len, n) + 1).sum() for n in p.seq_lens)  # query at position i sees i + 1 keys
    assert prefill_flops(p, q_len) == 4 * visible * p.q.shape[1] * p.q.shape[2]


def test_resident_pages_reads_only_the_first_pages():
    p = problem("tiny", "float32")
    resident = pagekv_decode(p, resident_pages=2)()
    k, v = p.k_cache.copy(), p.v_cache.copy()
    k[2:], v[2:] = np.nan, np.nan  # pages past the first two are never read
    table = p.block_table % np.int32(2)
    np.testing.assert_array_equal(attention.paged_decode_attention(p.q, k, v, table, p.seq_lens), resident)


def test_streaming_read_sums_every_element():
    run, num_bytes = streaming_read(1 << 20)
    assert run() == num_bytes // 4


@pytest.mark.parametrize("contiguous", [False, True])
def test_visit_order_sum_reads_every_page_once(contiguous):
    p = problem("tiny", "float32")  # every physical page belongs to some sequence
    rng = np.random.default_rng(2)
    k, v = (p.k_contiguous, p.v_contiguous) if contiguous else (p.k_cache, p.v_cache)
    k[...] = rng.integers(0, 8, k.shape)  # small integers: float32 sums are exact
    v[...] = rng.integers(0, 8, v.shape) * 16
    try:
        expected = k.sum(dtype=np.float64) + v.sum(dtype=np.float64)
        assert visit_order_sum(p, contiguous=contiguous)() == expected
    finally:
        problem.cache_clear()  # the pages were overwritten


def test_fma_chains_do_their_multiply_adds():
    rounds = 1000
    scale, step = np.float32(0.999999), np.float32(1e-7)
    chains = np.arange(CHAINS, dtype=np.float32)
    for _ in range(rounds):  # a fused multiply-add: the float32 product is exact in float64
        chains = (chains.astype(np.float64) * scale + step).astype(np.float32)
    assert _on_every_thread(rounds, 1) == pytest.approx(float(chains.sum(dtype=np.float64)), rel=1e-6)


def test_dot_pair_chains_add_both_products_of_each_pair():
    # each round adds 1.0 * 1.0 + 0.5 * 0.5 to every lane (exact in float32): vdpbf16ps where the
    # CPU has it, the portable emulation elsewhere; dropping either product of a pair changes it
    rounds = 1000
    expected = sum(float(chain) + 1.25 * rounds for chain in range(CHAINS))
    assert _dot_pairs_on_every_thread(rounds, 1) == expected
