"""report.py turns benchmark records into the README's tables: the cells say what was measured."""

from report import attention_tables, float8_table


def _decode(impl, median, **info):
    return {"stats": {"median": median, "min": median},
            "extra_info": dict(kind="decode", shape="S1", dtype="bfloat16", impl=impl, kv_bytes=2e9, **info)}


def _cases():
    return [
        {"stats": {"median": 0.2, "min": 0.1}, "extra_info": dict(kind="roof", kv_bytes=4e9)},
        _decode("pagekv", 0.1, share_of_roof=0.85, paired_roof_gbs=36.0),
        _decode("pagekv contiguous", 0.3, time_over_pagekv=0.8),
        _decode("pagekv no prefetch", 0.3, time_over_pagekv=1.9),
        _decode("pagekv float32 products", 0.3, time_over_pagekv=1.25),
        _decode("torch sdpa (dense)", 0.3, time_over_pagekv=29.5),
    ]


def _cells(benchmarks):
    row = attention_tables(benchmarks).splitlines()[-1]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_decode_ratios_are_the_paired_ones():
    # The medians say 3x for every baseline; the paired rounds say otherwise: the table must show
    # the paired ratios (the medians were taken minutes apart, in another memory state).
    floor = {"stats": {"median": 0.5, "min": 0.5},
             "extra_info": dict(kind="paging floor", shape="S1", dtype="bfloat16", kv_bytes=2e9,
                                paged_over_consecutive=1.07)}
    assert _cells(_cases() + [floor]) == ["S1", "bfloat16", "20.0", "85%", "36.0", "1.25", "1.07", "1.90",
                                          "1.25×", "29.50×", "—"]


def test_a_missing_paging_floor_leaves_its_cell_empty():
    assert _cells(_cases())[5:7] == ["1.25", "—"]


def test_float8_rows_show_their_bytes_share_and_times_over_bfloat16_and_the_fma_tiles():
    record = {"stats": {"median": 0.05, "min": 0.04},
              "extra_info": dict(kind="float8 decode", shape="S2", dtype="float8_e4m3fn", impl="pagekv",
                                 kv_bytes=1e9, share_of_roof=0.6, paired_roof_gbs=33.3,
                                 time_over_bfloat16=1.16)}
    assert float8_table([record]).splitlines()[-1] == "| S2 | 20.0 | 60% | 33.3 | 1.16 | — |"
    record["extra_info"]["fma_over_default"] = 1.734
    assert float8_table([record]).splitlines()[-1] == "| S2 | 20.0 | 60% | 33.3 | 1.16 | 1.73 |"
    assert float8_table(_cases()) == ""  # no float8 cases: no table
    assert all("float8" not in line for line in attention_tables(_cases() + [record]).splitlines())
