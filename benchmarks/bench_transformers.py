"""A transformers model on pagekv (PagedCache + "pagekv" attention) against its default path
(DynamicCache + sdpa), in one run: per generated token at 2K and 8K tokens of context (float32),
and per 2K-token prompt (the time to the first token; float32 and bfloat16).

    pytest benchmarks/bench_transformers.py --benchmark-only --benchmark-json=transformers.json
    python benchmarks/report.py transformers.json

One decode round = one decode forward of the whole batch (the cache grows by one token per round, under 1%
of the context over a benchmark). The default path's time includes DynamicCache's torch.cat growth,
which is what its users pay per token. The pagekv cases also record the ratio of the two paths in
rounds that alternate them (``extra_info["sdpa_over_pagekv"]``): each case alone is timed after
the other, minutes apart, and this host's memory bandwidth switches between two states in between
(the same cell read 0.75x and 1.42x in two runs).
"""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
transformers = pytest.importorskip(
    "transformers", reason="the transformers extra is not installed (pip install pagekv[transformers])")

from pagekv.integrations.transformers import PagedKVPool  # noqa: E402
from paired import paired_times  # noqa: E402

CONTEXTS = [2048, 8192]
BATCHES = [1, 4]
PAGE_SIZE = 16
# A small Llama with a real attention shape (head_dim 64, GQA 4:1) and random weights.
CONFIG = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)


def new_model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


@pytest.fixture(scope="module")
def model():
    return new_model()


@pytest.fixture(scope="module")
def twin():
    """The same weights in a second model: a PagedKVPool switches its model to pagekv attention
    while it is open, so the paired rounds run the default path on this one."""
    return new_model()


def cache_keyword(model):
    """forward's name for the cache: transformers 5.24 renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"


def prefilled(model, impl, batch, context):
    """A cache holding ``context`` prompt tokens per row, the keyword it goes under, the next tokens."""
    ids = torch.randint(1, CONFIG["vocab_size"], (batch, context), generator=torch.Generator().manual_seed(1))
    if impl == "pagekv":
        pool = PagedKVPool(model, num_pages=batch * (context + 256) // PAGE_SIZE, page_size=PAGE_SIZE)
        cache = pool.new_cache()
    else:
        pool, cache = None, transformers.DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    with torch.no_grad():
        logits = model(input_ids=ids, **{keyword: cache}).logits
    return pool, {keyword: cache}, logits[:, -1:].argmax(-1)


def stepper(model, cache_kwarg, next_ids):
    """One decode forward of the batch per call, feeding back its own greedy tokens."""
    state = {"ids": next_ids}

    def decode_step():
        with torch.no_grad():
            logits = model(input_ids=state["ids"], **cache_kwarg).logits
        state["ids"] = logits[:, -1:].argmax(-1)
    return decode_step


PAIRED_ROUNDS = 20


def sdpa_over_pagekv(twin, batch, context, pagekv_step):
    """Median over PAIRED_ROUNDS rounds of the default path's step time (on ``twin``) ÷ pagekv's,
    the two alternating (which goes first alternates too)."""
    _, cache_kwarg, next_ids = prefilled(twin, "sdpa", batch, context)
    sdpa_step = stepper(twin, cache_kwarg, next_ids)
    sdpa_step()
    pagekv_seconds, sdpa_seconds = paired_times(pagekv_step, sdpa_step, PAIRED_ROUNDS)
    return float(np.median(sdpa_seconds / pagekv_seconds))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("impl", ["pagekv", "sdpa"])
def test_decode_token(benchmark, model, twin, impl, batch, context):
    pool, cache_kwarg, next_ids = prefilled(model, impl, batch, context)
    decode_step = stepper(model, cache_kwarg, next_ids)
    benchmark.group = f"transformers decode|batch {batch}|context {context}"
    benchmark.extra_info.update(kind="transformers", impl=impl, batch=batch, context=context)
    try:
        if impl == "pagekv" and not benchmark.disabled:  # CI runs each case once, untimed
            benchmark.extra_info["sdpa_over_pagekv"] = sdpa_over_pagekv(twin, batch, context, decode_step)
        benchmark.pedantic(decode_step, rounds=30, warmup_rounds=2)
    finally:
        if pool is not None:
            pool.close()
            for cache in cache_kwarg.values():
                cache.release()


PROMPT_TOKENS = 2048
PREFILL_ROUNDS = 7


def prompt_forward(model, impl):
    """A callable running one PROMPT_TOKENS-token prompt into an empty cache (the time to the first
    token), and the pool to close (None for the default path). Prefix caching is off, so every call
    does the whole prompt's work."""
    ids = torch.randint(1, CONFIG["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(2))
    keyword = cache_keyword(model)
    pool = (PagedKVPool(model, num_pages=PROMPT_TOKENS // PAGE_SIZE + 1, page_size=PAGE_SIZE,
                        enable_prefix_caching=False) if impl == "pagekv" else None)

    def forward():
        cache = pool.new_cache() if pool is not None else transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, **{keyword: cache})
        if pool is not None:
            cache.release()
    return pool, forward


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["pagekv", "sdpa"])
def test_prefill_prompt(benchmark, impl, dtype):
    model = new_model().to(getattr(torch, dtype))
    pool, forward = prompt_forward(model, impl)
    benchmark.group = f"transformers prefill|{dtype}"
    benchmark.extra_info.update(kind="transformers prefill", impl=impl, dtype=dtype, context=PROMPT_TOKENS)
    try:
        if impl == "pagekv" and not benchmark.disabled:  # the default path on a twin, alternating
            _, sdpa_forward = prompt_forward(new_model().to(getattr(torch, dtype)), "sdpa")
            sdpa_forward()
            pagekv_seconds, sdpa_seconds = paired_times(forward, sdpa_forward, PREFILL_ROUNDS)
            benchmark.extra_info["sdpa_over_pagekv"] = float(np.median(sdpa_seconds / pagekv_seconds))
        benchmark.pedantic(forward, rounds=5, warmup_rounds=1)
    finally:
        if pool is not None:
            pool.close()
