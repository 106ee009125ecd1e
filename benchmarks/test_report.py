"""report.py turns benchmark records into the README's tables: the cells say what was measured."""

from report import attention_tables


def _decode(impl, median, **info):
    return {"stats": {"median": median, "min": median},
            "extra_info": dict(kind="decode", shape="S1", dtype="bfloat16", impl=impl, kv_bytes=2e9, **info)}


def test_decode_ratios_are_the_paired_ones():
    # The medians say 3x for every baseline; the paired rounds say otherwise: the table must show
    # the paired ratios (the medians were taken minutes apart, in another memory state).
    benchmarks = [
        {"stats": {"median": 0.2, "min": 0.1}, "extra_info": dict(kind="roof", kv_bytes=4e9)},
        _decode("pagekv", 0.1, share_of_roof=0.85, paired_roof_gbs=36.0),
        _decode("pagekv contiguous", 0.3, time_over_pagekv=0.8),
        _decode("pagekv no prefetch", 0.3, time_over_pagekv=1.9),
        _decode("pagekv float32 products", 0.3, time_over_pagekv=1.25),
        _decode("torch sdpa (dense)", 0.3, time_over_pagekv=29.5),
    ]
    row = attention_tables(benchmarks).splitlines()[-1]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells == ["S1", "bfloat16", "20.0", "85%", "36.0", "1.25", "1.90", "1.25×", "29.50×", "—"]
