"""Decode attention benchmarks: pagekv against the machine's bandwidth roof and what users run today.

Each case records the K/V bytes it must read (``extra_info["kv_bytes"]``); ``report.py`` divides by
the median time and by the streaming-read bandwidth measured in the same run. pagekv's own cases
also record their share of the roof measured in rounds that alternate the two
(``extra_info["share_of_roof"]``): this host's roof switches between ~35 and ~55 GB/s from minute
to minute, so a share against a roof timed at another moment read anywhere from 55% to 112%.

    pytest benchmarks/bench_attention.py --benchmark-only --benchmark-json=attention.json
    python benchmarks/report.py attention.json
"""

import functools
import importlib.util
import time

import numpy as np
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


ROOF_ROUNDS = 15


@functools.cache
def _roof():
    return streaming_read()


def share_of_roof(run, kv_bytes):
    """Median over ROOF_ROUNDS rounds of run's GB/s ÷ the roof's GB/s timed next to it, and the
    median roof of those rounds (GB/s)."""
    roof, roof_bytes = _roof()
    shares, roofs = [], []
    for _ in range(ROOF_ROUNDS):
        start = time.perf_counter()
        roof()
        middle = time.perf_counter()
        run()
        end = time.perf_counter()
        roofs.append(roof_bytes / (middle - start))
        shares.append(kv_bytes / (end - middle) / roofs[-1])
    return float(np.median(shares)), float(np.median(roofs)) / 1e9


def test_streaming_read_bandwidth(benchmark):
    run, num_bytes = _roof()
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
    if name == "pagekv" and not benchmark.disabled:  # CI runs the cases once, untimed
        share, roof_gbs = share_of_roof(run, p.kv_bytes)
        benchmark.extra_info.update(share_of_roof=share, paired_roof_gbs=roof_gbs)
    benchmark(run)
