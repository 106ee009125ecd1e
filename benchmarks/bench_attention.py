"""Decode attention benchmarks: pagekv against the machine's bandwidth roof and what users run today.

Each case records the K/V bytes it must read (``extra_info["kv_bytes"]``); ``report.py`` divides by
the median time and by the streaming-read bandwidth measured in the same run:

    pytest benchmarks/bench_attention.py --benchmark-only --benchmark-json=attention.json
    python benchmarks/report.py attention.json
"""

import importlib.util

import pytest

from attention_cases import (KINDS, numpy_gather_decode, pagekv_decode, problem, streaming_read,
                             torch_sdpa_decode)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
IMPLEMENTATIONS = {
    "pagekv": lambda p: pagekv_decode(p),
    "pagekv no prefetch": lambda p: pagekv_decode(p, prefetch=False),
    "pagekv float32 products": lambda p: pagekv_decode(p, fast_bf16=False),
    "pagekv contiguous": lambda p: pagekv_decode(p, contiguous=True),
    "numpy gather": numpy_gather_decode,
    "torch sdpa (dense)": torch_sdpa_decode,
}


def test_streaming_read_bandwidth(benchmark):
    run, num_bytes = streaming_read()
    benchmark.group = "roof: streaming read"
    benchmark.extra_info.update(kind="roof", kv_bytes=num_bytes)
    benchmark(run)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ["S1", "S2", "S3"])
def test_decode(benchmark, shape, kind, name):
    if name.startswith("torch") and not HAVE_TORCH:
        pytest.skip("torch is not installed (pip install torch==2.13.0 for the CPU build)")
    if name == "pagekv float32 products" and kind != "bfloat16":
        pytest.skip("float32 caches always multiply in float32")
    p = problem(shape, kind)
    run = IMPLEMENTATIONS[name](p)
    benchmark.group = f"decode {shape} {kind}"
    benchmark.extra_info.update(kind="decode", shape=shape, dtype=kind, impl=name,
                                kv_bytes=p.kv_bytes)
    benchmark(run)
