"""torch CPU tensors go through the attention wrappers without copies (runs where torch is installed)."""

import numpy as np
import pytest

from huge_pages import huge_page_kib, skip_unless_numpy_gets_huge_pages
from kv_builders import PagedKV
from pagekv import attention
from pagekv._arrays import START_PAST_4K, torch_zeros_on_line
from pagekv.reference import attention as reference

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_on_torch_caches_matches_numpy(dtype):
    kv = PagedKV(np.random.default_rng(0), [33, 7], num_kv_heads=2, head_dim=64, page_size=16,
                 kind="float32")
    torch_dtype = getattr(torch, dtype)
    k = torch.from_numpy(kv.k).to(torch_dtype)
    v = torch.from_numpy(kv.v).to(torch_dtype)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0)).to(torch_dtype)
    out = attention.paged_decode_attention(q, k, v, torch.from_numpy(kv.block_table),
                                           torch.from_numpy(kv.seq_lens).long())
    assert isinstance(out, torch.Tensor) and out.dtype == torch_dtype and out.shape == q.shape
    expected, _ = reference.decode(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                                   kv.block_table, kv.seq_lens)
    tolerance = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=tolerance, atol=tolerance)


def test_decode_on_torch_float8_caches_reads_their_bytes_without_a_copy():
    kv = PagedKV(np.random.default_rng(0), [33, 7], num_kv_heads=2, head_dim=64, page_size=16,
                 kind="float8_e4m3fn")
    k = torch.from_numpy(kv.k).view(torch.float8_e4m3fn)
    v = torch.from_numpy(kv.v).view(torch.float8_e4m3fn)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    out = attention.paged_decode_attention(q, k, v, kv.block_table, kv.seq_lens)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    expected, _ = reference.decode(q.float().numpy(), k.float().numpy(), v.float().numpy(),
                                   kv.block_table, kv.seq_lens)
    np.testing.assert_allclose(out.float().numpy(), expected, rtol=1e-2, atol=1e-2)
    k.view(torch.uint8)[...] = 0  # the kernels read the tensor's own memory: every key 0
    flat = attention.paged_decode_attention(q.float(), k, v, kv.block_table, kv.seq_lens)
    uniform, _ = reference.decode(q.float().numpy(), np.zeros(k.shape), v.float().numpy(),
                                  kv.block_table, kv.seq_lens)
    np.testing.assert_allclose(flat.numpy(), uniform, rtol=1e-5, atol=1e-6)


def test_small_float_arguments_come_in_any_float_dtype():
    """ALiBi slopes and log-sum-exps as torch computes them (float64 included) mean their float32
    values."""
    kv = PagedKV(np.random.default_rng(1), [20], num_kv_heads=1, head_dim=64, page_size=16,
                 kind="float32")
    q = np.random.default_rng(2).standard_normal((1, 2, 64), dtype=np.float32)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    expected = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                                alibi_slopes=slopes.float().numpy())
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        out = attention.paged_decode_attention(q, kv.k, kv.v, kv.block_table, kv.seq_lens,
                                               alibi_slopes=slopes.to(dtype))
        np.testing.assert_array_equal(out, expected)  # 0.5 and 0.25 are exact in every dtype
    o = torch.ones(1, 2, 8)
    merged, lse = attention.merge_states(o, torch.zeros(1, 2, dtype=torch.float64), o,
                                         torch.zeros(1, 2, dtype=torch.float64))
    np.testing.assert_allclose(lse, np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(merged, 1.0, rtol=1e-6)


def test_out_and_cache_writes_land_in_the_callers_storage():
    k = torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    new = torch.ones(2, 1, 64, dtype=torch.bfloat16)
    attention.write_kv(new, new * 2, k, v, torch.tensor([17, 3]))
    assert k[1, 0, 1].float().eq(1).all() and v[0, 0, 3].float().eq(2).all()  # written in place
    q = torch.ones(1, 1, 64, dtype=torch.bfloat16)
    out = torch.full((1, 1, 64), float("nan"), dtype=torch.bfloat16)
    result = attention.paged_decode_attention(q, k, v, torch.tensor([[0, 1]], dtype=torch.int32),
                                              torch.tensor([18], dtype=torch.int32), out=out)
    assert result is out and not torch.isnan(out).any()


def test_non_cpu_or_non_float_tensors_are_refused():
    k = torch.zeros(4, 1, 16, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="expected float32, float16, bfloat16 or float8_e4m3fn .* "
                                        "for k_cache, got torch.float64"):
        attention.paged_decode_attention(torch.zeros(1, 1, 64), k, k, [[0]], [1])
    meta = torch.zeros(4, 1, 16, 64, device="meta")
    with pytest.raises(ValueError, match="expected a CPU tensor for k_cache, got device meta"):
        attention.paged_decode_attention(torch.zeros(1, 1, 64), meta, meta, [[0]], [1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_kv_cache_over_an_engines_torch_tensor(dtype):
    from pagekv import KVCache, KVCacheSpec

    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype=dtype)
    owned = torch.zeros(1, 2, 5, 2, 4, 8, dtype=getattr(torch, dtype))
    cache = KVCache(spec, 5, storage=owned)
    new = torch.full((1, 2, 8), 3.0, dtype=torch.bfloat16)  # rounded to float8 where the cache is
    attention.write_kv(new, new, cache.k(0), cache.v(0), [6])
    assert owned[0, :, 1, :, 2].float().eq(3).all()
    assert not owned[0, :, [0, 2, 3, 4]].float().any() and not owned[0, :, 1, :, [0, 1, 3]].float().any()
    with pytest.raises(TypeError, match=f"expected storage of dtype {dtype}"):
        KVCache(spec, 5, storage=torch.zeros(1, 2, 5, 2, 4, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_torch_zeros_on_line_is_zeros_on_a_line(dtype):
    tensor = torch_zeros_on_line((3, 5, 64), getattr(torch, dtype))
    assert tensor.dtype == getattr(torch, dtype) and tensor.shape == (3, 5, 64) and tensor.is_contiguous()
    assert not tensor.float().any() and tensor.data_ptr() % 4096 == START_PAST_4K


def test_torch_zeros_on_line_gets_huge_pages_where_numpy_does():
    # torch.zeros gets none here (its allocator does not ask), and decode from such a cache took
    # 1.17-1.19x the time (pagekv/_arrays.py)
    nbytes = 64 << 20
    skip_unless_numpy_gets_huge_pages(nbytes)
    tensor = torch_zeros_on_line((nbytes // 2,), torch.bfloat16)
    tensor += 1  # touch every page
    assert huge_page_kib(tensor.data_ptr(), nbytes) >= (nbytes >> 10) // 2
