"""Next-page software prefetch in the decode kernel, at page sizes 16, 32 and 128, both dtypes.

    python benchmarks/prefetch_study.py [--rounds 30]

For each page size and KV dtype (shapes S1 and S3 of attention_cases.py) three variants run in
interleaved rounds — contiguous pages, random page order, random order with ``prefetch=True`` — so
the machine's drift hits all three alike; the table gives median times as ratios to contiguous.
"""

import argparse
import time

import numpy as np

from attention_cases import pagekv_decode, problem

PAGE_SIZES = (16, 32, 128)


def study(shape, kind, page_size, rounds):
    p = problem(shape, kind, page_size)
    variants = {"contiguous": pagekv_decode(p, contiguous=True), "paged": pagekv_decode(p),
                "paged + prefetch": pagekv_decode(p, prefetch=True)}
    times = {name: [] for name in variants}
    for run in variants.values():
        run()
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: float(np.median(t)) for name, t in times.items()}
    return median, p.kv_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print("| shape | KV | page | contiguous GB/s | paged ÷ contiguous | paged+prefetch ÷ contiguous |")
    print("|---|---|---|---|---|---|")
    for shape in ("S1", "S3"):
        for kind in ("float32", "bfloat16"):
            for page_size in PAGE_SIZES:
                median, nbytes = study(shape, kind, page_size, args.rounds)
                base = median["contiguous"]
                print(f"| {shape} | {kind} | {page_size} | {nbytes / base / 1e9:.1f} | "
                      f"{median['paged'] / base:.2f} | {median['paged + prefetch'] / base:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
