"""pagekv inside Hugging Face transformers: generate() with PagedCache + "pagekv" attention must give
what transformers' own DynamicCache + sdpa gives, on tiny models built from configs in code (random
weights, no download)."""

import dataclasses
import gc
import inspect
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install pagekv[transformers])")

from transformers import DynamicCache  # noqa: E402

from huge_pages import huge_page_kib, skip_unless_numpy_gets_huge_pages  # noqa: E402
from pagekv import OutOfPagesError, PagekvError  # noqa: E402
from pagekv.attention import gather_kv  # noqa: E402
from pagekv.integrations.transformers import PagedCache, PagedKVPool  # noqa: E402
from pagekv.reference import float8  # noqa: E402

# transformers 5.24 renamed forward's and generate's `past_key_values` to `cache`
CACHE = "cache" if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters else "past_key_values"
VOCAB = 512
GREEDY = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
FLOAT8_LOGITS_ATOL = 0.05  # measured 0.024-0.028 on three prompts (logits up to ~0.9)


def tiny(family="llama", *, dtype=torch.float32, **overrides):
    """A 2-layer model of ``family`` with seeded random weights (GQA: 4 query heads, 2 KV heads)."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[family]
    options = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    options.update(overrides)
    torch.manual_seed(0)
    return model_class(config_class(**options)).to(dtype).eval()


def left_padded(lengths, *, seed=1, prefix=()):
    """int64 [batch, max_len] prompts (``prefix`` then random ids) left-padded with 0, and the mask."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.tensor(prefix, dtype=torch.long),
                       torch.randint(1, VOCAB, (n - len(prefix),), generator=g)]) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


def reference(model, ids, mask, **kwargs):
    """transformers' default path: DynamicCache + sdpa, or eager where transformers has no sdpa
    (Gemma2): the model's attention before any pool."""
    assert model.config._attn_implementation in ("sdpa", "eager")
    return model.generate(input_ids=ids, attention_mask=mask, **GREEDY, **kwargs)


def assert_same_generation(ours, ref, *, logits_atol):
    np.testing.assert_array_equal(ours.sequences.numpy(), ref.sequences.numpy())
    for step, (a, b) in enumerate(zip(ours.logits, ref.logits)):
        np.testing.assert_allclose(a.float().numpy(), b.float().numpy(), atol=logits_atol, rtol=0,
                                   err_msg=f"logits of step {step}")


@pytest.fixture
def llama():
    return tiny("llama")


def test_greedy_generation_matches_sdpa_token_for_token(llama):
    ids, mask = left_padded([1, 17, 63, 65])  # around page boundaries (page 16), one 1-token prompt
    ref = reference(llama, ids, mask, max_new_tokens=32)
    pool = PagedKVPool(llama, num_pages=64, page_size=16)
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=32, **GREEDY)
    assert_same_generation(ours, ref, logits_atol=1e-4)
    stats = pool.stats()
    assert stats.num_seqs == 0 and stats.pages_used == stats.pages_cached  # released; only cache left
    pool.manager.check()


@pytest.mark.parametrize("page_size", [1, 7, 64])
def test_page_sizes_and_chunked_prefill_match_sdpa(llama, page_size):
    ids, mask = left_padded([9, 40, 23], seed=2)
    ref = reference(llama, ids, mask, max_new_tokens=12)
    pool = PagedKVPool(llama, num_pages=512, page_size=page_size)
    # prefill_chunk_size: the prompt arrives in 16-column forwards, each attending to the pages
    # of the chunks before it (the prefill kernel over a cached prefix)
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=12, prefill_chunk_size=16, **GREEDY)
    assert_same_generation(ours, ref, logits_atol=1e-4)


def test_second_call_with_the_same_system_prompt_reuses_its_pages(llama):
    system = list(range(100, 148))  # 48 tokens = 3 full pages of 16
    first_ids, first_mask = left_padded([60, 75], seed=3, prefix=system)
    second_ids, second_mask = left_padded([52, 90, 49], seed=4, prefix=system)
    ref = reference(llama, second_ids, second_mask, max_new_tokens=16)
    pool = PagedKVPool(llama, num_pages=128, page_size=16)
    pool.generate(first_ids, attention_mask=first_mask, max_new_tokens=16, **GREEDY)
    before = pool.stats()
    ours = pool.generate(second_ids, attention_mask=second_mask, max_new_tokens=16, **GREEDY)
    after = pool.stats()
    assert_same_generation(ours, ref, logits_atol=1e-4)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 3 * 48  # every row hit 3 pages


def test_a_cache_salt_keeps_the_pages_of_other_weights_apart(llama):
    """Switching adapters changes the KV of the same tokens: each adapter's generations under its
    own salt share no page with the other's and match transformers; under the same salt they hit."""
    system = list(range(100, 148))  # 3 full pages of 16
    ids, mask = left_padded([60, 75], seed=3, prefix=system)
    k_proj = llama.model.layers[0].self_attn.k_proj.weight
    original = k_proj.detach().clone()
    with torch.no_grad():
        k_proj.mul_(1.5)                                  # "adapter b"
    ref_b = reference(llama, ids, mask, max_new_tokens=8)
    with torch.no_grad():
        k_proj.copy_(original)                            # "adapter a"
    pool = PagedKVPool(llama, num_pages=128, page_size=16)
    pool.generate(ids, attention_mask=mask, max_new_tokens=8, cache_salt="adapter-a", **GREEDY)
    with torch.no_grad():
        k_proj.mul_(1.5)
    hits = pool.stats().prefix_hit_tokens
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=8, cache_salt=b"adapter-b", **GREEDY)
    assert pool.stats().prefix_hit_tokens - hits == 48   # row 2 on row 1's system prompt; no page of a's
    assert_same_generation(ours, ref_b, logits_atol=1e-4)
    hits = pool.stats().prefix_hit_tokens
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=8, cache_salt=b"adapter-b", **GREEDY)
    assert pool.stats().prefix_hit_tokens - hits == 48 + 64  # every full page of both prompts
    assert_same_generation(ours, ref_b, logits_atol=1e-4)
    with pytest.raises(TypeError, match="expected cache_salt None, bytes or str, got int 7"):
        pool.new_cache(cache_salt=7)


@pytest.mark.parametrize("lengths", [[5, 33, 20], [33, 5]])  # padding before and after a full row
def test_pages_hold_the_keys_and_values_transformers_computes(llama, lengths):
    ids, mask = left_padded(lengths, seed=5)
    dense = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: dense})
    pool = PagedKVPool(llama, num_pages=32, page_size=16)
    cache = pool.new_cache()
    attended = []  # what the attention hands layer 0's output projection
    hook = llama.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: attended.append(a[0]))
    with torch.no_grad():
        llama.model(ids, attention_mask=mask, **{CACHE: cache})  # the base model, input_ids by position
    hook.remove()
    assert (attended[0][mask == 0] == 0).all()  # padding positions get zeros, never a stale row
    assert cache.get_seq_length() == ids.shape[1]  # columns, padding included, as transformers counts
    tables = pool.manager.batch(cache._seq_ids)
    for layer in range(llama.config.num_hidden_layers):
        k, v, indptr = gather_kv(pool.storage[layer, 0], pool.storage[layer, 1],
                                 tables.block_table, tables.seq_lens)
        for row in range(len(ids)):
            real = mask[row].bool()
            for paged, layer_cache in ((k, dense.layers[layer].keys), (v, dense.layers[layer].values)):
                expected = layer_cache[row][:, real].transpose(0, 1).numpy()  # [tokens, heads, dim]
                np.testing.assert_allclose(paged[indptr[row]:indptr[row + 1]], expected, atol=1e-5)
    cache.release()
    assert pool.stats().num_seqs == 0


@pytest.mark.parametrize("family, overrides", [
    ("mistral", dict(sliding_window=24)),  # window shorter than the prompts: the kernels' window
    ("qwen2", dict()),                      # q/k/v biases
    # scores soft-capped (weights 10x the default scale, so the cap bends scores: without it the
    # logits move by 3.6), sliding and full layers alternating, scale 1/sqrt(256) at head_dim 32
    ("gemma2", dict(head_dim=32, sliding_window=24, attn_logit_softcapping=1.0, initializer_range=0.2)),
])
def test_other_families_match_transformers(family, overrides):
    model = tiny(family, **overrides)
    ids, mask = left_padded([30, 47, 11], seed=6)
    ref = reference(model, ids, mask, max_new_tokens=16)
    pool = PagedKVPool(model, num_pages=64, page_size=16)
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=16, **GREEDY)
    assert_same_generation(ours, ref, logits_atol=1e-4)


@pytest.mark.parametrize("dtype, atol", [("bfloat16", 0.05), ("float16", 0.01)])
def test_16_bit_models_keep_16_bit_pages_and_close_logits(dtype, atol):
    model = tiny("llama", dtype=getattr(torch, dtype))
    ids, mask = left_padded([19, 40], seed=7)
    ref = reference(model, ids, mask, max_new_tokens=1)
    pool = PagedKVPool(model, num_pages=16, page_size=16)
    assert pool.storage.dtype == getattr(torch, dtype) and pool.spec.dtype == dtype
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=1, **GREEDY)
    # the attention output is rounded to 16 bits once on each path, at different points: a few ulps
    np.testing.assert_allclose(ours.logits[0].float().numpy(), ref.logits[0].float().numpy(), atol=atol)


def test_a_float8_pool_holds_the_float8_rounding_of_each_key_and_value(llama):
    """kv_dtype="float8_e4m3fn": pages of half bfloat16's bytes; layer 0's pages (its keys and
    values depend on the embeddings alone, not on earlier attention) hold exactly the float8
    rounding (the twin's) of what transformers computes, and the logits stay near the float32
    path's."""
    ids, mask = left_padded([5, 33, 20], seed=5)
    dense = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: dense})
    ref = reference(llama, ids, mask, max_new_tokens=1)
    pool = PagedKVPool(llama, num_pages=32, page_size=16, kv_dtype="float8_e4m3fn")
    assert pool.storage.dtype == torch.float8_e4m3fn and pool.spec.dtype == "float8_e4m3fn"
    assert pool.storage.element_size() == pool.spec.itemsize == 1
    cache = pool.new_cache()
    with torch.no_grad():
        llama.model(ids, attention_mask=mask, **{CACHE: cache})
    tables = pool.manager.batch(cache._seq_ids)
    k, v, indptr = gather_kv(pool.storage[0, 0], pool.storage[0, 1], tables.block_table, tables.seq_lens)
    for row in range(len(ids)):
        real = mask[row].bool()
        for paged, layer_cache in ((k, dense.layers[0].keys), (v, dense.layers[0].values)):
            expected = layer_cache[row][:, real].transpose(0, 1).numpy()
            np.testing.assert_array_equal(paged[indptr[row]:indptr[row + 1]], float8.encode(expected))
    cache.release()
    ours = pool.generate(ids, attention_mask=mask, max_new_tokens=1, **GREEDY)
    np.testing.assert_allclose(ours.logits[0].numpy(), ref.logits[0].numpy(), atol=FLOAT8_LOGITS_ATOL)


def test_the_pool_keeps_its_pages_in_huge_pages(llama):
    nbytes = 64 << 20  # 2 layers x K/V x 4096 pages x 2 heads x 16 tokens x 32 dims, float32
    skip_unless_numpy_gets_huge_pages(nbytes)
    pool = PagedKVPool(llama, num_pages=4096)
    assert pool.storage.numel() * pool.storage.element_size() == nbytes
    pool.storage += 1  # touch every page
    assert huge_page_kib(pool.storage.data_ptr(), nbytes) >= (nbytes >> 10) // 2
    pool.close()


def test_close_gives_the_model_back_to_sdpa(llama):
    ids, mask = left_padded([8, 12], seed=8)
    ref = reference(llama, ids, mask, max_new_tokens=4)
    pool = PagedKVPool(llama, num_pages=16)
    assert llama.config._attn_implementation == "pagekv"
    pool.close()
    assert not llama.model._forward_pre_hooks and not llama.model._forward_hooks  # unhooked
    again = reference(llama, ids, mask, max_new_tokens=4)
    np.testing.assert_array_equal(again.sequences.numpy(), ref.sequences.numpy())


def test_pool_defaults_and_a_table_no_longer_than_the_models_context(llama):
    pool = PagedKVPool(llama, num_pages=1024)
    assert (pool.manager.page_size, pool.manager.free_rows) == (16, 64)
    assert pool.manager.max_pages_per_seq == 2048 // 16  # max_position_embeddings, not the pool


def test_a_released_or_reset_cache_serves_a_new_batch_of_another_size(llama):
    batches = [left_padded(lengths, seed=len(lengths)) for lengths in ([6, 9], [7, 3, 5], [4])]
    with torch.no_grad():
        expected = [llama(input_ids=ids, attention_mask=mask, **{CACHE: DynamicCache(config=llama.config)}).logits
                    for ids, mask in batches]
    pool = PagedKVPool(llama, num_pages=32, page_size=4)
    cache = pool.new_cache()
    for (ids, mask), want, end in zip(batches, expected, (cache.release, cache.reset, None)):
        with torch.no_grad():
            got = llama(input_ids=ids, attention_mask=mask, **{CACHE: cache}).logits
            more = torch.ones(len(ids), 1, dtype=mask.dtype)
            llama(input_ids=ids[:, :1], attention_mask=torch.cat([mask, more], 1), **{CACHE: cache})
        cache.crop(-1)                          # by this batch's masks, not the last one's
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
        assert cache.get_seq_length() == ids.shape[1] and pool.stats().num_tokens == mask.sum()
        if end:
            end()
            assert cache.get_seq_length() == 0 and pool.stats().num_seqs == 0
    pool.manager.check()


def test_training_mode_is_refused_only_with_attention_dropout():
    ids, mask = left_padded([5], seed=26)
    for dropout in (0.0, 0.1):
        model = tiny("llama", attention_dropout=dropout).train()
        pool = PagedKVPool(model, num_pages=8, page_size=4)
        with torch.no_grad():
            if dropout:
                with pytest.raises(PagekvError, match="expected inference .* got dropout=0.1 in training mode"):
                    model(input_ids=ids, attention_mask=mask, **{CACHE: pool.new_cache()})
            else:
                model(input_ids=ids, attention_mask=mask, **{CACHE: pool.new_cache()})


def test_a_dropped_cache_frees_its_sequences(llama):
    ids, mask = left_padded([20, 30], seed=9)
    pool = PagedKVPool(llama, num_pages=16, page_size=16, enable_prefix_caching=False)
    cache = pool.new_cache()
    llama.generate(input_ids=ids, attention_mask=mask, **{CACHE: cache}, max_new_tokens=3,
                   do_sample=False, pad_token_id=0)
    assert pool.stats().num_seqs == 2
    del cache
    gc.collect()
    assert pool.stats().num_seqs == 0 and pool.stats().pages_used == 0


# ------------------------------------------------------------------------------------ bad input
def test_importing_the_integration_registers_its_attention_for_from_pretrained(tmp_path):
    """``attn_implementation="pagekv"`` is known as soon as the module is imported (a fresh process:
    no pool has registered it; run outside the repository, whose source folder would shadow the
    installed package)."""
    code = ("import pagekv.integrations.transformers; from transformers import AttentionInterface; "
            "print('pagekv' in AttentionInterface().valid_keys())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path)
    assert out.stdout.split() == ["True"]


def test_pagekv_attention_without_a_paged_cache_says_so(llama):
    assert PagedKVPool(llama, num_pages=16).cache_keyword == CACHE
    ids, mask = left_padded([6], seed=10)
    with pytest.raises(PagekvError, match="expected a PagedCache"):
        llama(input_ids=ids, attention_mask=mask, **{CACHE: DynamicCache(config=llama.config)})


@pytest.mark.parametrize("options, message", [
    (dict(num_pages="64"), "expected num_pages a positive integer, got '64'"),
    (dict(num_pages=0), "expected num_pages a positive integer, got 0"),
    (dict(num_pages=64, enable_prefix_caching="no"), "expected enable_prefix_caching a bool"),
    (dict(num_pages=64, kv_dtype="int8"), "expected kv_dtype None or one of float32, float16, "
                                          "bfloat16, float8_e4m3fn, got 'int8'"),
])
def test_a_bad_pool_size_or_flag_is_refused_and_the_model_keeps_its_attention(llama, options, message):
    with pytest.raises(ValueError, match=message):
        PagedKVPool(llama, **options)
    assert llama.config._attn_implementation == "sdpa"


def test_a_pool_larger_than_memory_is_refused_before_touching_it(llama):
    with pytest.raises(MemoryError, match=r"expected a page pool within the .* GiB available, "
                                          r"got 100000000 pages x"):
        PagedKVPool(llama, num_pages=10**8)
    assert llama.config._attn_implementation == "sdpa"


def test_input_ids_not_batch_by_columns_are_refused(llama):
    pool = PagedKVPool(llama, num_pages=16)
    for ids in (torch.tensor([5, 6, 7]), torch.zeros((1, 0), dtype=torch.long)):
        with pytest.raises(ValueError, match=r"expected input_ids of shape \[batch, q_len >= 1\], got "):
            llama.model(input_ids=ids, **{CACHE: pool.new_cache()})
    assert pool.stats().pages_used == 0


def test_inputs_embeds_only_is_refused(llama):
    pool = PagedKVPool(llama, num_pages=16)
    embeds = llama.get_input_embeddings()(torch.tensor([[5, 6, 7]]))
    with pytest.raises(PagekvError, match="expected input_ids"):
        llama(inputs_embeds=embeds, **{CACHE: pool.new_cache()})
    assert pool.stats().pages_used == 0


def test_bad_masks_change_nothing_and_padding_rows_wait_for_their_first_token(llama):
    pool = PagedKVPool(llama, num_pages=16)
    ids, mask = left_padded([4, 9], seed=11)
    cache = pool.new_cache()
    with pytest.raises(ValueError, match=r"expected a 2-D attention_mask of shape \(2, 9\)"):
        llama(input_ids=ids, attention_mask=mask[:, 1:], **{CACHE: cache})
    assert pool.stats() == PagedKVPool(tiny(), num_pages=16).stats()  # an untouched pool's figures
    assert cache.get_seq_length() == 0 and cache._seq_ids == []
    mask[0] = 0  # row 0 all padding: no sequence until a real token arrives
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
        assert pool.stats().num_seqs == 1 and cache._seq_ids[0] is None
        with pytest.raises(ValueError, match="expected the batch of 2 rows"):
            llama(input_ids=ids[:1, :1], attention_mask=mask[:1], **{CACHE: cache})
        llama(input_ids=ids[:, :1], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
              **{CACHE: cache})
    assert pool.stats().num_seqs == 2 and pool.stats().num_tokens == 1 + 10


def test_running_out_of_pages_adds_no_sequence_and_caches_no_unwritten_page(llama):
    """Row 0 of the prompt forward gets its pages, row 1 does not: row 0 is taken back, and its
    full page, cached when handed out but never written, leaves the prefix cache (the same prompt
    later hit it and read zeros: logits off by 0.9)."""
    pool = PagedKVPool(llama, num_pages=3, page_size=16)
    ids, mask = left_padded([20, 20], seed=12)  # 2 pages each, 4 needed
    with pytest.raises(OutOfPagesError):
        pool.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    stats = pool.stats()
    assert stats.num_seqs == 0 and stats.pages_used == stats.pages_cached == 0
    pool.manager.check()
    ours = pool.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=3, **GREEDY)
    pool.close()
    assert_same_generation(ours, reference(llama, ids[:1], mask[:1], max_new_tokens=3), logits_atol=1e-5)


def test_a_chunk_that_runs_out_of_pages_is_taken_back_and_the_cache_goes_on(llama):
    """Chunked prefill: the second chunk fits row 0, not row 1. Row 0's chunk is cut back (its
    filled page out of the prefix cache) and the cache is as before the chunk, still usable."""
    pool = PagedKVPool(llama, num_pages=5, page_size=4)
    ids, mask = left_padded([6, 6], seed=23)
    more = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(24))
    cache = pool.new_cache()
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})   # 2 pages each: 4 of 5
        before = (pool.stats(), [pool.manager.page_table(s).tolist() for s in cache._seq_ids])
        with pytest.raises(OutOfPagesError):
            llama(input_ids=more, attention_mask=torch.ones(2, 14, dtype=mask.dtype), **{CACHE: cache})
        assert (pool.stats(), [pool.manager.page_table(s).tolist() for s in cache._seq_ids]) == before
        assert cache.get_seq_length() == 6
        pool.manager.check()
        got = llama(input_ids=more[:, :2], attention_mask=torch.ones(2, 8, dtype=mask.dtype),
                    **{CACHE: cache}).logits
    pool.close()
    with torch.no_grad():
        dense = DynamicCache(config=llama.config)
        llama(input_ids=ids, attention_mask=mask, **{CACHE: dense})
        want = llama(input_ids=more[:, :2], attention_mask=torch.ones(2, 8, dtype=mask.dtype),
                     **{CACHE: dense}).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("failing", ["prompt", "decode"])
def test_a_forward_that_raises_is_taken_back_and_can_run_again(llama, monkeypatch, failing, error):
    """A forward that fails inside the model (here: writing layer 1's KV) leaves its pages half
    written. It is taken back as it raises (a KeyboardInterrupt, which torch's hooks do not see,
    at the next forward): none of its pages stays cached (the decode token fills a page, cached
    when handed out, as the prompt fills three), and run again it gives what it would have."""
    import pagekv.integrations.transformers as integration

    pool = PagedKVPool(llama, num_pages=16, page_size=4)
    ids, mask = left_padded([11], seed=25)
    token = torch.tensor([[7]])
    full, full_mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    step = dict(input_ids=token if failing == "decode" else full, attention_mask=full_mask)
    calls = []
    write = integration.write_kv

    def failing_write(*args):
        calls.append(1)
        if len(calls) == 2:
            raise error("a layer failed")
        return write(*args)

    def state():  # the prefix lookup counters count the failed forward's lookup too
        occupancy = dataclasses.replace(pool.stats(), prefix_hit_tokens=0, prefix_query_tokens=0)
        return occupancy, [pool.manager.page_table(s).tolist() for s in cache._seq_ids], cache._seq_ids[:]

    cache = pool.new_cache()
    with torch.no_grad():
        if failing == "decode":
            llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
        before = state()
        monkeypatch.setattr(integration, "write_kv", failing_write)
        with pytest.raises(error, match="a layer failed"):
            llama(**step, **{CACHE: cache})
        monkeypatch.setattr(integration, "write_kv", write)
        if error is RuntimeError:
            assert state() == before
            pool.manager.check()
        got = llama(**step, **{CACHE: cache}).logits
    assert cache.get_seq_length() == 12
    cache.release()
    stats = pool.stats()
    assert stats.num_seqs == 0 and stats.pages_used == stats.pages_cached == 3
    pool.close()
    with torch.no_grad():
        dense = DynamicCache(config=llama.config)
        if failing == "decode":
            llama(input_ids=ids, attention_mask=mask, **{CACHE: dense})
        want = llama(**step, **{CACHE: dense}).logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)


def test_release_takes_back_an_interrupted_forward_and_caches_none_of_its_pages(llama, monkeypatch):
    import pagekv.integrations.transformers as integration

    pool = PagedKVPool(llama, num_pages=16, page_size=4)
    ids, mask = left_padded([12], seed=26)

    def interrupted(*args):
        raise KeyboardInterrupt

    cache = pool.new_cache()
    monkeypatch.setattr(integration, "write_kv", interrupted)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
    assert len(pool.manager.prefix) == 3  # handed out, never written: cached until taken back
    cache.release()
    assert pool.stats().pages_used == len(pool.manager.prefix) == 0
    pool.manager.check()
    pool.close()


def test_beam_search_forks_rows_and_matches_sdpa(llama):
    ids, mask = left_padded([11, 30], seed=14)
    kwargs = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False,
                  pad_token_id=0)
    ref = llama.generate(input_ids=ids, attention_mask=mask, **kwargs)
    pool = PagedKVPool(llama, num_pages=128, page_size=4)
    ours = pool.generate(ids, attention_mask=mask, **kwargs)
    np.testing.assert_array_equal(ours.numpy(), ref.numpy())
    assert pool.stats().num_seqs == 0
    pool.manager.check()
    cache = pool.new_cache()
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
    rows, before = list(cache._seq_ids), pool.stats()
    for bad, message in ((torch.tensor([0, 2]), r"expected beam_idx a 1-D list of row indices in \[0, 2\)"),
                         ([0], "expected beam_idx of 2 row indices, got 1")):
        with pytest.raises(ValueError, match=message):
            cache.reorder_cache(bad)
        assert cache._seq_ids == rows and pool.stats() == before


def test_selecting_and_repeating_rows_fork_them_and_match_a_dynamic_cache(llama):
    """A left-padded batch of two prefilled, each row repeated (parallel samples of one prompt),
    rows selected (one of them twice), a token cropped, and forwards between: the logits are
    those of transformers' DynamicCache treated the same way, and repeated rows share pages."""
    ids, mask = left_padded([6, 19], seed=19)
    g = torch.Generator().manual_seed(20)
    steps = [torch.randint(1, VOCAB, (4, 2), generator=g), torch.randint(1, VOCAB, (3, 1), generator=g),
             torch.randint(1, VOCAB, (3, 2), generator=g)]
    pages = []

    def logits(cache, pool=None):
        out = []
        with torch.no_grad():
            llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
            used = pool and pool.stats().pages_used
            cache.batch_repeat_interleave(2)
            if pool:
                pages.append((used, pool.stats().pages_used, pool.stats().num_seqs))
            m = mask.repeat_interleave(2, 0)
            for step, rows in zip(steps, ([3, 0, 0], None, None)):
                m = torch.cat([m, torch.ones_like(step)], 1)
                out.append(llama(input_ids=step, attention_mask=m, **{CACHE: cache}).logits)
                if rows:
                    cache.batch_select_indices(torch.tensor(rows))
                    m = m[rows]
                    cache.crop(-1)
                    m = m[:, :-1]
        return out

    expected = logits(DynamicCache(config=llama.config))
    pool = PagedKVPool(llama, num_pages=64, page_size=4)
    for got, want in zip(logits(pool.new_cache(), pool), expected):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5, rtol=0)
    assert pages == [(pages[0][0], pages[0][0], 4)]  # 4 rows on the pages of 2: nothing copied
    pool.manager.check()


def test_row_operations_refuse_bad_input_and_need_rows_only_for_forks(llama):
    pool = PagedKVPool(llama, num_pages=32, page_size=4, max_seqs=3)
    ids, mask = left_padded([5, 9], seed=21)
    cache = pool.new_cache()
    cache.batch_repeat_interleave(3)  # nothing held yet: nothing to repeat
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
    for call, message in [
            (lambda: cache.batch_select_indices([0, 2]), r"expected indices a 1-D list of row indices in \[0, 2\)"),
            (lambda: cache.batch_select_indices([-1]), r"in \[0, 2\), got \[-1\]"),
            (lambda: cache.batch_select_indices([[0]]), "expected indices a 1-D list"),
            (lambda: cache.batch_select_indices([0.0]), "expected indices a 1-D list"),
            (lambda: cache.batch_select_indices([]), "expected at least one row index, got none"),
            (lambda: cache.batch_repeat_interleave(0), "expected repeats a positive integer, got 0"),
            (lambda: cache.batch_repeat_interleave(True), "expected repeats a positive integer, got True"),
            (lambda: cache.batch_repeat_interleave(2), r"expected 2 free sequence rows .* got 1"),
            (lambda: cache.batch_select_indices([0, 1, 1, 1]), r"expected 2 free sequence rows .* got 1")]:
        before = (list(cache._seq_ids), pool.stats(), [r.copy() for r in cache._real])
        with pytest.raises(ValueError, match=message):
            call()
        after = (list(cache._seq_ids), pool.stats(), cache._real)
        assert after[:2] == before[:2] and all((a == b).all() for a, b in zip(after[2], before[2]))
    first, second = cache._seq_ids
    before = (list(cache._seq_ids), pool.stats())
    cache.batch_repeat_interleave(1)            # each row once: nothing changes
    assert (list(cache._seq_ids), pool.stats()) == before
    cache.reorder_cache([1, 1])   # one fork, into the row the dropped sequence frees first
    assert cache._seq_ids[0] == second and first not in pool.manager
    cache.batch_select_indices([1, 0, 0])
    assert cache._seq_ids[1] == second and pool.stats().num_seqs == 3
    pool.manager.check()
    full = PagedKVPool(llama, num_pages=32, page_size=4, max_seqs=2)  # no row free at all
    cache = full.new_cache()
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
    cache.reorder_cache([1, 1])                 # the dropped row's sequence makes room for the fork
    assert full.stats().num_seqs == 2 and full.manager.free_rows == 0


def noisy_copy(model, scale):
    """``model`` with its weights perturbed by ``scale`` of each one's spread: a draft model that
    agrees with it often, not always. Drafts 5 tokens per step, whatever its confidence."""
    draft = tiny("llama")
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    draft.generation_config.num_assistant_tokens = 5
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    return draft


def test_assisted_generation_rolls_back_rejected_drafts_and_matches_transformers(llama, monkeypatch):
    """Speculative decoding: the target model verifies 5 drafted tokens per forward, appended to
    its pages, and crop() drops the rejected ones (KVCacheManager.truncate), across page
    boundaries (page 4): the tokens and logits are those of transformers' own assisted generate."""
    ids, mask = left_padded([37], seed=22)
    kwargs = dict(max_new_tokens=30, assistant_model=noisy_copy(llama, 0.2))
    ref = reference(llama, ids, mask, **kwargs)
    pool = PagedKVPool(llama, num_pages=64, page_size=4)
    crops = []
    crop = PagedCache.crop
    monkeypatch.setattr(PagedCache, "crop", lambda cache, n: (crops.append(n), crop(cache, n))[1])
    ours = pool.generate(ids, attention_mask=mask, **GREEDY, **kwargs)
    assert_same_generation(ours, ref, logits_atol=1e-5)
    assert min(crops) <= -3 and -1 in crops and 0 in crops[:-1]  # drafts rejected, some, all kept
    assert pool.stats().num_seqs == 0
    pool.manager.check()


def test_crop_drops_each_rows_last_tokens_and_later_forwards_match_a_cropped_dynamic_cache(llama):
    """A left-padded batch of two, three tokens appended, two cropped, two others appended: the
    logits are those of transformers' DynamicCache cropped the same way, and each row's sequence
    holds its real tokens only."""
    ids, mask = left_padded([6, 19], seed=16)
    g = torch.Generator().manual_seed(17)
    drafts, others = (torch.randint(1, VOCAB, (2, n), generator=g) for n in (3, 2))

    def last_logits(cache):
        with torch.no_grad():
            llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
            llama(input_ids=drafts, attention_mask=torch.cat([mask, torch.ones_like(drafts)], 1), **{CACHE: cache})
            cache.crop(-2)
            assert cache.get_seq_length() == 19 + 1
            return llama(input_ids=others, attention_mask=torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1),
                         **{CACHE: cache}).logits

    expected = last_logits(DynamicCache(config=llama.config))  # before the pool takes the model's attention
    pool = PagedKVPool(llama, num_pages=32, page_size=4)
    paged = pool.new_cache()
    np.testing.assert_allclose(last_logits(paged).numpy(), expected.numpy(), atol=1e-5, rtol=0)
    assert [pool.manager.seq_len(s) for s in paged._seq_ids] == [6 + 1 + 2, 19 + 1 + 2]
    for bad in (1, -23, 2.0, True):
        before = (pool.stats(), paged.get_seq_length(), list(paged._seq_ids))
        with pytest.raises(ValueError, match=rf"expected tokens_to_remove a negative count of the 22 "
                                             rf"columns held \(or 0\), got {bad}"):
            paged.crop(bad)
        assert (pool.stats(), paged.get_seq_length(), list(paged._seq_ids)) == before
    paged.crop(0)
    assert paged.get_seq_length() == 22
    pool.manager.check()


def test_crop_of_every_real_token_of_a_row_frees_its_sequence_until_its_next_token(llama):
    pool = PagedKVPool(llama, num_pages=16, page_size=4)
    ids, mask = left_padded([5, 9], seed=18)
    mask[0] = 0  # row 0 all padding in the prompt: its first tokens come with the next forward
    cache = pool.new_cache()
    more = torch.ones(2, 2, dtype=mask.dtype)
    with torch.no_grad():
        llama(input_ids=ids, attention_mask=mask, **{CACHE: cache})
        llama(input_ids=ids[:, :2], attention_mask=torch.cat([mask, more], 1), **{CACHE: cache})
        assert [pool.manager.seq_len(s) for s in cache._seq_ids] == [2, 11]
        cache.crop(-2)
        assert cache._seq_ids[0] is None and pool.manager.seq_len(cache._seq_ids[1]) == 9
        assert pool.stats().num_seqs == 1
        pool.manager.check()
        llama(input_ids=ids[:, :2], attention_mask=torch.cat([mask, more], 1), **{CACHE: cache})
    assert [pool.manager.seq_len(s) for s in cache._seq_ids] == [2, 11]
    cache.crop(-cache.get_seq_length())         # every column: every row freed
    assert cache._seq_ids == [None, None] and pool.stats().num_seqs == 0 and cache.get_seq_length() == 0


def test_the_example_runs_and_agrees_with_transformers():
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "transformers_generate.py"
    result = subprocess.run([sys.executable, str(example), "--compare", "--max-new-tokens", "8"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("same tokens as transformers' default path: True") == 2
    hits = [int(part.split()[0]) for part in result.stdout.split("hits so far: ")[1:]]
    assert len(hits) == 2 and hits[1] > hits[0]  # the second call reused the first call's pages
