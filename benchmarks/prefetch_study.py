"""Software prefetch in the decode and prefill kernels at page sizes 16, 32 and 128, both dtypes;
and what jumping between pages costs the memory system by itself.

    python benchmarks/prefetch_study.py [--rounds 30] [--page-sizes 16 32 128] [--decode-only]

For each page size and KV dtype (decode: shapes S1 and S3 of attention_cases.py; prefill: S1's
caches with each sequence's last 128 tokens as queries) runs alternate in interleaved rounds, so
the machine's drift hits all alike: the streaming-read roof, contiguous pages, random page order
(both with the default prefetch), random page order with ``prefetch=False``, and for decode the
same step with every logical page mapped onto 512 KiB of physical pages ("from cache": the same
arithmetic with no memory traffic, the ceiling the loops set whatever the memory) and a plain sum
of the same pages in the kernel's visit order with its prefetch stream, on the random pages and on
consecutive ones ("visit order, sum only": the memory traffic with no arithmetic, and what random
page order costs that traffic by itself). The table gives GB/s as shares of the roof and median
times as ratios to contiguous; the last two columns, the speed decode's multiply-adds alone would
allow at the machine's multiply-add peak for that dtype (fma_peak.py, measured once at the start:
float32 FMAs, or vdpbf16ps for bfloat16 where the CPU has it) as a share of the roof, and the
multiply-adds the kernel does from cache as a share of that peak.
The second table reads 512 MiB in chunks of 8 KiB to 512 KiB, in order and in random order, with the
same visit-order sum and no prefetch: the floor of what random page order costs without it.
"""

import argparse
import time

import numba
import numpy as np

from attention_cases import pagekv_decode, pagekv_prefill, problem, streaming_read
from fma_peak import multiply_add_peaks
from visit_order import visit_order_sum, visit_sum

PAGE_SIZES = (16, 32, 128)
RESIDENT_BYTES = 512 * 1024  # K pages per "from cache" run (and as many V): L2-sized


def prefill_variants(p):
    """Chunked prefill (attention_cases.pagekv_prefill): each sequence's last PREFILL_TOKENS tokens
    attend to its whole paged context."""
    return {"contiguous": pagekv_prefill(p, contiguous=True), "paged": pagekv_prefill(p),
            "paged, no prefetch": pagekv_prefill(p, prefetch=False)}


def study(shape, kind, page_size, rounds, roof, *, op="decode"):
    p = problem(shape, kind, page_size)
    variants = ({"contiguous": pagekv_decode(p, contiguous=True), "paged": pagekv_decode(p),
                 "paged, no prefetch": pagekv_decode(p, prefetch=False),
                 "from cache": pagekv_decode(p, resident_pages=RESIDENT_BYTES // p.k_cache[0].nbytes),
                 "visit order, sum only": visit_order_sum(p),
                 "visit order on consecutive pages, sum only": visit_order_sum(p, contiguous=True)}
                if op == "decode" else prefill_variants(p))
    variants["roof"] = roof
    times = {name: [] for name in variants}
    for run in variants.values():
        run()
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    median = {name: float(np.median(t)) for name, t in times.items()}
    return median, p.kv_bytes, decode_fmas(p)


def decode_fmas(p):
    """Multiply-adds of one decode step: each query head's scores and weighted values, one per
    element of each K and V row it reads."""
    return 2 * p.q.shape[1] * p.q.shape[2] * int(p.seq_lens.sum())


def memory_floor(rounds):
    rng = np.random.default_rng(0)
    print("\n| chunk | in order GB/s | random order GB/s | random ÷ in order time |")
    print("|---|---|---|---|")
    for kib in (8, 16, 32, 64, 128, 512):
        data = rng.standard_normal((512 * 1024 // kib, kib * 256), dtype=np.float32)
        slots = np.linspace(0, len(data), numba.get_num_threads() + 1).astype(np.int64)
        orders = {"in order": np.arange(len(data)), "random": rng.permutation(len(data))}
        visits = {name: np.stack([np.zeros_like(order), order], axis=1) for name, order in orders.items()}
        times = {"in order": [], "random": []}
        visit_sum(data, data, visits["in order"], slots, 0)
        for _ in range(max(3, rounds // 4)):
            for name, chunks in visits.items():
                start = time.perf_counter()
                visit_sum(data, data, chunks, slots, 0)
                times[name].append(time.perf_counter() - start)
        a, b = np.median(times["in order"]), np.median(times["random"])
        print(f"| {kib} KiB | {data.nbytes / a / 1e9:.1f} | {data.nbytes / b / 1e9:.1f} | {b / a:.2f} |",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=PAGE_SIZES, metavar="N",
                        help="page sizes to study (default: %(default)s)")
    parser.add_argument("--decode-only", action="store_true", help="skip prefill and the memory floor")
    args = parser.parse_args()
    roof, roof_bytes = streaming_read()
    peaks = multiply_add_peaks()
    print(f"multiply-add peak on {numba.get_num_threads()} threads: "
          + ", ".join(f"{kind} {peak / 1e9:.0f} G/s" for kind, peak in peaks.items()) + "\n")
    print("| op | shape | KV | page | roof GB/s | paged GB/s | % of roof | paged ÷ contiguous | "
          "paged, no prefetch ÷ contiguous | from cache, % of roof | visit order, sum only, % of roof | "
          "visit order, sum only, paged ÷ contiguous | decode's multiply-adds alone at peak, % of roof | "
          "from cache, % of the multiply-add peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ops = (("decode", ("S1", "S3")),) + ((("prefill", ("S1",)),) if not args.decode_only else ())
    for op, shapes in ops:
        for shape in shapes:
            for kind in ("float32", "bfloat16"):
                for page_size in args.page_sizes:
                    # prefill is compute-bound and ~50x slower per call: fewer rounds
                    rounds = args.rounds if op == "decode" else max(3, args.rounds // 5)
                    median, nbytes, fmas = study(shape, kind, page_size, rounds, roof, op=op)
                    base, paged = median["contiguous"], median["paged"]
                    roof_gbs = roof_bytes / median["roof"]
                    share = nbytes / paged / roof_gbs
                    cached, visits = (f"{100 * nbytes / median[name] / roof_gbs:.0f}%"
                                      if name in median else "—"
                                      for name in ("from cache", "visit order, sum only"))
                    sums = "visit order, sum only", "visit order on consecutive pages, sum only"
                    visit_paging = f"{median[sums[0]] / median[sums[1]]:.2f}" if sums[0] in median else "—"
                    peak = peaks[kind]
                    fma_share = f"{100 * nbytes / (fmas / peak) / roof_gbs:.0f}%" if op == "decode" else "—"
                    busy = (f"{100 * fmas / median['from cache'] / peak:.0f}%"
                            if "from cache" in median else "—")
                    print(f"| {op} | {shape} | {kind} | {page_size} | {roof_gbs / 1e9:.1f} | "
                          f"{nbytes / paged / 1e9:.1f} | "
                          f"{100 * share:.0f}% | {paged / base:.2f} | "
                          f"{median['paged, no prefetch'] / base:.2f} | {cached} | {visits} | "
                          f"{visit_paging} | {fma_share} | {busy} |", flush=True)
    if not args.decode_only:
        memory_floor(args.rounds)


if __name__ == "__main__":
    main()
