"""How fast a decode reads memory against how fast its arithmetic runs from cache.

    python benchmarks/arithmetic_study.py [--shape S1] [--kinds float32 bfloat16] \
        [--groups 1 2 4 6 8] [--rounds 7]

One shape's caches (its sequences, KV heads, head_dim and pages) decoded with ``group`` query
heads per KV head: the same bytes read, ``group`` multiply-adds per element. Each group's decode
runs from memory on random and on consecutive pages (the last-level cache evicted before each
call) and from cache (every logical page mapped onto 512 KiB of physical pages: the arithmetic
with no memory traffic), in rounds that also time the streaming-read roof; the table gives the
rounds' medians. If memory and arithmetic overlapped perfectly, a decode would read
min(roof, from-cache rate); if not at all, 1 / (1/roof + 1/from-cache rate), the last column.
On the Intel Xeon (docs/performance.md, "What the 85% needs here") the random-page read rose
with the from-cache rate alike for every kernel, a few points above that last column.
"""

import argparse
import time

import numpy as np

from ab_installs import RESIDENT_BYTES
from attention_cases import KINDS, SHAPES, pagekv_decode, problem, streaming_read


def grouped(shape, group):
    """The name of ``shape`` with ``group`` query heads per KV head, registered in SHAPES."""
    name = f"{shape}/group {group}"
    cfg = SHAPES[shape]
    SHAPES.setdefault(name, dict(cfg, num_q_heads=group * cfg["num_kv_heads"]))
    return name


def no_overlap_share(from_cache):
    """The share of the roof read if memory and arithmetic took turns: ``from_cache`` is the
    arithmetic's rate as a multiple of the roof."""
    return from_cache / (1.0 + from_cache)


def decodes(name, kind):
    """(bytes one call reads, {"from cache", "random", "consecutive": a decode call})."""
    p = problem(name, kind)
    runs = {"from cache": pagekv_decode(p, resident_pages=max(1, RESIDENT_BYTES // p.k_cache[0].nbytes)),
            "random": pagekv_decode(p),
            "consecutive": pagekv_decode(p, contiguous=True)}
    for run in runs.values():
        run()  # compiled, and its pages touched
    return p.kv_bytes, runs


def measure(cases, rounds, roof, roof_bytes):
    """Per case, the medians over ``rounds`` of each of its runs' rate as a share of the roof
    timed in the same round. cases: {label: (bytes, runs)} from :func:`decodes`."""
    shares = {label: {run: [] for run in runs} for label, (_, runs) in cases.items()}
    for _ in range(rounds):
        for label, (nbytes, runs) in cases.items():
            start = time.perf_counter()
            roof()  # timed, and evicts the last-level cache
            roof_rate = roof_bytes / (time.perf_counter() - start)
            for run_name, run in runs.items():
                if run_name != "from cache":
                    roof()
                start = time.perf_counter()
                run()
                shares[label][run_name].append(nbytes / (time.perf_counter() - start) / roof_rate)
    return {label: {run: float(np.median(values)) for run, values in runs.items()}
            for label, runs in shares.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S1", choices=[s for s in SHAPES if "/" not in s])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 2, 4, 6, 8])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    roof, roof_bytes = streaming_read()
    cases = {(kind, group): decodes(grouped(args.shape, group), kind)
             for kind in args.kinds for group in args.groups}
    results = measure(cases, args.rounds, roof, roof_bytes)
    print("| KV dtype | group | from cache, × roof | random pages, % of roof | consecutive | "
          "no overlap |")
    print("|---|---|---|---|---|---|")
    for (kind, group), shares in results.items():
        cached = shares["from cache"]
        print(f"| {kind} | {group} | {cached:.2f} | {100 * shares['random']:.0f}% | "
              f"{100 * shares['consecutive']:.0f}% | {100 * no_overlap_share(cached):.0f}% |")


if __name__ == "__main__":
    main()
