"""Turn a pytest-benchmark JSON file into the README's markdown tables (ratios measured in one run).

    python benchmarks/report.py allocator.json
"""

import json
import sys
from collections import defaultdict

BASELINES = ["deque", "linked_list", "first_fit"]


def per_page_ns(bench):
    return bench["stats"]["median"] / bench["extra_info"]["pages_per_call"] * 1e9


def allocator_tables(benchmarks):
    by_workload = defaultdict(dict)
    memory = {}
    for bench in benchmarks:
        info = bench["extra_info"]
        if "bytes_per_page" in info:
            memory[info["allocator"]] = info["bytes_per_page"]
        elif "workload" in info:
            by_workload[(info["workload"], info["pool"])][info["allocator"]] = per_page_ns(bench)

    lines = ["| workload | pool | pagekv ns/page | deque | linked list | first fit "
             "| deque ÷ pagekv | linked list ÷ pagekv |",
             "|---|---|---|---|---|---|---|---|"]
    for (workload, pool), ns in sorted(by_workload.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        cells = [f"{ns[name]:.1f}" if name in ns else "—" for name in ["pagekv", *BASELINES]]
        ratios = [f"{ns[name] / ns['pagekv']:.1f}×" if name in ns and "pagekv" in ns else "—"
                  for name in BASELINES[:2]]
        lines.append(f"| {workload} | 2^{pool.bit_length() - 1} | " + " | ".join(cells + ratios) + " |")

    growth = []
    for workload in sorted({w for w, _ in by_workload}):
        pools = sorted(p for w, p in by_workload if w == workload)
        for name in ["pagekv", "first_fit"]:
            have = [p for p in pools if name in by_workload[(workload, p)]]
            if len(have) > 1:
                first, last = by_workload[(workload, have[0])][name], by_workload[(workload, have[-1])][name]
                growth.append(f"- {workload}, {name}: per-page cost at 2^{have[-1].bit_length() - 1} "
                              f"is {last / first:.2f}× that at 2^{have[0].bit_length() - 1}")
    if memory:
        lines += ["", "| allocator | resident bookkeeping, bytes per page |", "|---|---|"]
        lines += [f"| {name} | {value:.2f} |" for name, value in memory.items()]
    return "\n".join(lines + [""] + growth)


def attention_tables(benchmarks):
    roof = [b for b in benchmarks if b["extra_info"].get("kind") == "roof"]
    if not roof:
        return ""
    roof_gbs = roof[0]["extra_info"]["kv_bytes"] / roof[0]["stats"]["min"] / 1e9
    cases = defaultdict(dict)  # (shape, dtype) -> {impl: extra_info, with the median time}
    floors = {}  # (shape, dtype) -> the memory's own paged ÷ consecutive time (bench_attention.py)
    for bench in benchmarks:
        info = bench["extra_info"]
        if info.get("kind") == "decode":
            cases[(info["shape"], info["dtype"])][info["impl"]] = dict(info, median=bench["stats"]["median"])
        elif info.get("kind") == "paging floor" and "paged_over_consecutive" in info:
            floors[(info["shape"], info["dtype"])] = info["paged_over_consecutive"]
    if not cases:
        return ""
    lines = [f"Streaming-read roof (same run, same threads): {roof_gbs:.1f} GB/s; \"% of roof\" pairs "
             "each pagekv run with a roof timed next to it (median of the rounds' ratios; the rounds' median "
             "roof beside it); the ratio columns pair each implementation with pagekv the same way",
             "",
             "| shape | KV dtype | pagekv GB/s | % of roof | paired roof GB/s | paged ÷ contiguous time "
             "| same, memory alone | no prefetch ÷ prefetch "
             "| float32 products ÷ bfloat16 | × torch SDPA (dense) | × NumPy gather |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, dtype), impls in sorted(cases.items()):
        pagekv = impls["pagekv"]
        gbs = pagekv["kv_bytes"] / pagekv["median"] / 1e9

        def ratio(name, *, speedup=True, inverse=False):
            """The paired time ratio of implementation ``name`` over pagekv, as a cell."""
            if "time_over_pagekv" not in impls.get(name, {}):
                return "—"
            value = impls[name]["time_over_pagekv"]
            return f"{1 / value if inverse else value:.2f}" + ("×" if speedup else "")

        floor = f"{floors[(shape, dtype)]:.2f}" if (shape, dtype) in floors else "—"
        lines.append(f"| {shape} | {dtype} | {gbs:.1f} | {100 * pagekv['share_of_roof']:.0f}% "
                     f"| {pagekv['paired_roof_gbs']:.1f} "
                     f"| {ratio('pagekv contiguous', speedup=False, inverse=True)} | {floor} "
                     f"| {ratio('pagekv no prefetch', speedup=False)} | {ratio('pagekv float32 products')} "
                     f"| {ratio('torch sdpa (dense)')} | {ratio('numpy gather')} |")
    return "\n".join(lines)


def float8_table(benchmarks):
    """The float8 pages' decode: GB/s of their own bytes, share of the roof, time over bfloat16's,
    and the FMA tiles' time over the default's (where measured)."""
    rows = [(b["extra_info"], b["stats"]["median"]) for b in benchmarks
            if b["extra_info"].get("kind") == "float8 decode" and "time_over_bfloat16" in b["extra_info"]]
    if not rows:
        return ""
    lines = ["| shape | float8 GB/s | % of roof | paired roof GB/s | float8 ÷ bfloat16 time | "
             "FMA tiles ÷ default time |",
             "|---|---|---|---|---|---|"]
    for info, median in sorted(rows, key=lambda row: row[0]["shape"]):
        fma = f"{info['fma_over_default']:.2f}" if "fma_over_default" in info else "—"
        lines.append(f"| {info['shape']} | {info['kv_bytes'] / median / 1e9:.1f} "
                     f"| {100 * info['share_of_roof']:.0f}% | {info['paired_roof_gbs']:.1f} "
                     f"| {info['time_over_bfloat16']:.2f} | {fma} |")
    return "\n".join(lines)


def _paired_cell(paired, key):
    return f"{paired[key]:.2f}× |" if key in paired else "— |"


def prefill_table(benchmarks):
    cases, paired = defaultdict(dict), {}
    for bench in benchmarks:
        info = bench["extra_info"]
        if info.get("kind") == "prefill":
            key = (info["shape"], info["dtype"], info["q_tokens"])
            cases[key][info["impl"]] = info["flops"] / bench["stats"]["median"] / 1e9
            if "sdpa_over_pagekv" in info:
                paired[key] = info["sdpa_over_pagekv"]
    if not cases:
        return ""
    lines = ["| shape | KV dtype | new tokens per sequence | pagekv GFLOP/s | torch SDPA (dense) GFLOP/s "
             "| SDPA ÷ pagekv time | same, paired rounds |", "|---|---|---|---|---|---|---|"]
    for (shape, dtype, q_tokens), gflops in sorted(cases.items()):
        sdpa = gflops.get("torch sdpa (dense)")
        lines.append(f"| {shape} | {dtype} | {q_tokens} | {gflops['pagekv']:.0f} | "
                     + (f"{sdpa:.0f} | {gflops['pagekv'] / sdpa:.2f}× | " if sdpa else "— | — | ")
                     + _paired_cell(paired, (shape, dtype, q_tokens)))
    return "\n".join(lines)


def manager_table(benchmarks):
    rows = [b for b in benchmarks if b["extra_info"].get("kind") == "manager"]
    if not rows:
        return ""
    lines = ["| operation | implementation | µs per unit | unit |", "|---|---|---|---|"]
    by_op = defaultdict(dict)
    for bench in rows:
        info = bench["extra_info"]
        per_unit = bench["stats"]["median"] / info["units_per_call"] * 1e6
        by_op[info["op"]][info["impl"]] = per_unit
        lines.append(f"| {info['op']} | {info['impl']} | {per_unit:.3f} | {info['unit']} |")
    for op, impls in by_op.items():
        if "pagekv" in impls and len(impls) > 1:
            for name, value in impls.items():
                if name != "pagekv":
                    lines.append(f"\n{op}: pagekv is {value / impls['pagekv']:.1f}× faster than {name}")
    return "\n".join(lines)


def _times_and_pairs(benchmarks, kind, key):
    """Median ms per (key fields) and implementation, and the paired sdpa ÷ pagekv ratios, of the
    transformers cases of ``kind``."""
    ms, paired = defaultdict(dict), {}
    for bench in benchmarks:
        info = bench["extra_info"]
        if info.get("kind") != kind:
            continue
        ms[tuple(info[k] for k in key)][info["impl"]] = bench["stats"]["median"] * 1e3
        if "sdpa_over_pagekv" in info:
            paired[tuple(info[k] for k in key)] = info["sdpa_over_pagekv"]
    return ms, paired


def transformers_table(benchmarks):
    ms, paired = _times_and_pairs(benchmarks, "transformers", ("batch", "context"))
    if not ms:
        return ""
    lines = ["| batch | context | pagekv ms/token | sdpa + DynamicCache ms/token | sdpa ÷ pagekv "
             "| sdpa ÷ pagekv, paired rounds |",
             "|---|---|---|---|---|---|"]
    for (batch, context), impls in sorted(ms.items()):
        lines.append(f"| {batch} | {context} | {impls['pagekv']:.2f} | {impls['sdpa']:.2f} "
                     f"| {impls['sdpa'] / impls['pagekv']:.2f}× | " + _paired_cell(paired, (batch, context)))
    return "\n".join(lines)


def transformers_prefill_table(benchmarks):
    ms, paired = _times_and_pairs(benchmarks, "transformers prefill", ("dtype", "context"))
    if not ms:
        return ""
    lines = ["| dtype | prompt tokens | pagekv ms | sdpa + DynamicCache ms | sdpa ÷ pagekv "
             "| sdpa ÷ pagekv, paired rounds |", "|---|---|---|---|---|---|"]
    for (dtype, context), impls in sorted(ms.items()):
        lines.append(f"| {dtype} | {context} | {impls['pagekv']:.0f} | {impls['sdpa']:.0f} "
                     f"| {impls['sdpa'] / impls['pagekv']:.2f}× | " + _paired_cell(paired, (dtype, context)))
    return "\n".join(lines)


def swap_table(benchmarks):
    rows = {b["extra_info"]["op"]: b for b in benchmarks if b["extra_info"].get("kind") == "swap"}
    if "numpy copyto" not in rows:
        return ""
    base = rows["numpy copyto"]
    base_gbs = base["extra_info"]["nbytes"] / base["stats"]["median"] / 1e9
    lines = ["| operation | GB/s | ÷ plain copy |", "|---|---|---|"]
    for op, bench in rows.items():
        gbs = bench["extra_info"]["nbytes"] / bench["stats"]["median"] / 1e9
        lines.append(f"| {op} | {gbs:.1f} | {gbs / base_gbs:.0%} |")
    return "\n".join(lines)


def main(path):
    with open(path) as f:
        data = json.load(f)
    machine = data["machine_info"]
    print(f"Machine: {machine.get('cpu', {}).get('brand_raw', '?')}, "
          f"{machine.get('cpu', {}).get('count', '?')} cores; Python {machine['python_version']}; "
          f"run {data['datetime'][:10]}\n")
    if any("pages_per_call" in b["extra_info"] for b in data["benchmarks"]):
        print(allocator_tables(data["benchmarks"]))
    print(attention_tables(data["benchmarks"]))
    print(float8_table(data["benchmarks"]))
    print(prefill_table(data["benchmarks"]))
    print(manager_table(data["benchmarks"]))
    print(transformers_table(data["benchmarks"]))
    print(transformers_prefill_table(data["benchmarks"]))
    print(swap_table(data["benchmarks"]))


if __name__ == "__main__":
    main(sys.argv[1])
