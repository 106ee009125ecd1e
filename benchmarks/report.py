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


def main(path):
    with open(path) as f:
        data = json.load(f)
    machine = data["machine_info"]
    print(f"Machine: {machine.get('cpu', {}).get('brand_raw', '?')}, "
          f"{machine.get('cpu', {}).get('count', '?')} cores; Python {machine['python_version']}; "
          f"run {data['datetime'][:10]}\n")
    print(allocator_tables(data["benchmarks"]))


if __name__ == "__main__":
    main(sys.argv[1])
