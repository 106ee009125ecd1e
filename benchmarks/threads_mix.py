"""Two thread pools in one process: torch's intra-op pool and Numba's, alternating like a model's layers.

    python benchmarks/threads_mix.py [--repeat 3]   # every setup, each in its own process
    python benchmarks/threads_mix.py --child "default (omp, spin unchanged)"   # one setup, one process

torch ships its own libgomp and Numba's "omp" layer loads the system one, so a torch process running
pagekv has two OpenMP pools whose idle workers spin (GOMP_SPINCOUNT) while the other pool works.
Each setup runs in a fresh process (the OpenMP runtimes read their settings when they load) and times
a torch linear (64 x 1024 by 1024 x 1024: torch's pool runs it, 1.7x faster on two threads than on
one), one pagekv decode, and both in sequence (the mix), in blocks of one variant. ``mix ÷ parts``
above 1 is what alternating costs. The control runs everything on one thread (no pools at all): what
it pays is the cost of alternating two workloads as such (caches), which no threading setup removes.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SETUPS = {
    # name: (environment for the whole process, GOMP_SPINCOUNT for Numba's pool only)
    "default (omp, spin unchanged)": ({}, None),
    "OMP_WAIT_POLICY=PASSIVE (both pools)": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "GOMP_SPINCOUNT=10000 (both pools)": ({"GOMP_SPINCOUNT": "10000"}, None),
    "GOMP_SPINCOUNT=10000 (Numba's pool only)": ({}, "10000"),
    "GOMP_SPINCOUNT=0 (Numba's pool only)": ({}, "0"),
    "NUMBA_THREADING_LAYER=workqueue": ({"NUMBA_THREADING_LAYER": "workqueue"}, None),
    # The system libgomp loaded before torch: torch then binds to it (same soname) and Numba's pool
    # finds the same file, so both run on one OpenMP runtime and one set of workers.
    "one OpenMP runtime (system libgomp first)": ({"THREADS_MIX_ONE_RUNTIME": "1"}, None),
    "control: one thread each (no pools)": ({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}, None),
}


def child(numba_spin):
    if os.environ.get("THREADS_MIX_ONE_RUNTIME"):
        import ctypes

        ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
    import torch

    if numba_spin is not None:  # seen only by the libgomp that Numba's pool loads now
        os.environ["GOMP_SPINCOUNT"] = numba_spin
    import numba

    numba.get_num_threads()  # starts Numba's pool
    if numba_spin is not None:
        del os.environ["GOMP_SPINCOUNT"]
    from pagekv.attention import paged_decode_attention

    rng = np.random.default_rng(0)
    seqs, context, kv_heads, q_heads, head_dim, page = 4, 1024, 2, 8, 64, 16
    pages = seqs * context // page
    k = rng.standard_normal((pages, kv_heads, page, head_dim), dtype=np.float32)
    table = rng.permutation(pages).astype(np.int32).reshape(seqs, -1)
    lens = np.full(seqs, context, np.int32)
    q = rng.standard_normal((seqs, q_heads, head_dim), dtype=np.float32)
    weight, x = torch.randn(1024, 1024), torch.randn(64, 1024)

    def torch_part():
        torch.nn.functional.linear(x, weight)

    def pagekv_part():
        paged_decode_attention(q, k, k, table, lens)

    def mix():
        torch_part()
        pagekv_part()

    parts = {"torch": torch_part, "pagekv": pagekv_part, "mix": mix}
    for fn in parts.values():
        for _ in range(20):
            fn()
    times = {name: [] for name in parts}
    # Blocks of one variant (inside a block the other pool has gone idle: "alone" means alone),
    # the blocks interleaved three times so drift in the machine hits every variant alike.
    for _ in range(3):
        for name, fn in parts.items():
            for _ in range(200):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
    medians.update(layer=numba.threading_layer(), torch_threads=torch.get_num_threads(),
                   numba_threads=numba.get_num_threads())
    print(json.dumps(medians))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per setup (default 3)")
    args = parser.parse_args()
    if args.child:
        child(SETUPS[args.child][1])
        return
    print("| setup | threads (torch / Numba) | torch ms | pagekv ms | mix ms | mix ÷ parts (each run) |")
    print("|---|---|---|---|---|---|")
    for name, (env, _) in SETUPS.items():
        runs = []
        for _ in range(args.repeat):
            result = subprocess.run([sys.executable, __file__, "--child", name], check=True,
                                    capture_output=True, text=True, env={**os.environ, **env})
            runs.append(json.loads(result.stdout))
        r = runs[0]
        median = {key: float(np.median([run[key] for run in runs])) for key in ("torch", "pagekv", "mix")}
        ratios = ", ".join(f"{run['mix'] / (run['torch'] + run['pagekv']):.2f}" for run in runs)
        print(f"| {name} | {r['torch_threads']} / {r['numba_threads']} ({r['layer']}) | "
              f"{median['torch']:.3f} | {median['pagekv']:.3f} | {median['mix']:.3f} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
