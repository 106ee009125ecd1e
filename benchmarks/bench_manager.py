"""KVCacheManager benchmarks: the decode step's bookkeeping and a prefix lookup.

    pytest benchmarks/bench_manager.py --benchmark-only --benchmark-json=manager.json
    python benchmarks/report.py manager.json
"""

import numpy as np
import pytest

from pagekv import KVCacheManager
from pagekv.prefix import chain_keys
from pagekv.reference.manager import ReferenceKVCacheManager

NUM_SEQS = 256
PAGE_SIZE = 16
STEPS = 16  # one call = 16 decode steps: every sequence crosses a page boundary once
MANAGERS = {"pagekv": KVCacheManager, "python twin": ReferenceKVCacheManager}


def decode_setup(name):
    """256 sequences of 1,024 prompt tokens (page-aligned: every 16th step needs a new page)."""
    m = MANAGERS[name](num_pages=NUM_SEQS * 80, page_size=PAGE_SIZE, max_seqs=NUM_SEQS,
                       max_pages_per_seq=80)
    rng = np.random.default_rng(0)
    for s in range(NUM_SEQS):
        m.add_sequence(s, rng.integers(0, 32000, 1024).tolist())
    seq_ids = list(range(NUM_SEQS))
    tokens = rng.integers(0, 32000, (STEPS, NUM_SEQS)).tolist()
    return (m, seq_ids, tokens), {}


def decode_steps(m, seq_ids, tokens):
    for step_tokens in tokens:
        m.append_tokens(seq_ids, step_tokens)


@pytest.mark.parametrize("name", MANAGERS)
def test_decode_step_bookkeeping(benchmark, name):
    benchmark.group = f"decode step bookkeeping|{NUM_SEQS} seqs"
    benchmark.extra_info.update(kind="manager", op="decode step", impl=name,
                                units_per_call=NUM_SEQS * STEPS, unit="sequence-step")
    benchmark.pedantic(decode_steps, setup=lambda: decode_setup(name), rounds=15, warmup_rounds=1)


def test_prefix_lookup_4096_tokens(benchmark):
    m = KVCacheManager(num_pages=1024, page_size=PAGE_SIZE, max_seqs=4, max_pages_per_seq=300)
    prompt = np.random.default_rng(1).integers(0, 32000, 4096 + 1).astype(np.int32)
    m.add_sequence("cached", prompt)
    benchmark.group = "prefix lookup|4096 tokens"
    benchmark.extra_info.update(kind="manager", op="prefix lookup 4096 tokens", impl="pagekv",
                                units_per_call=1, unit="lookup")
    pages = benchmark(lambda: m.prefix.lookup(chain_keys(prompt, PAGE_SIZE)))
    assert len(pages) == 4096 // PAGE_SIZE
