"""Two thread pools in one process: torch's intra-op pool and Numba's, alternating like a model's layers.

    python benchmarks/threads_mix.py            # every setup, each in its own process
    python benchmarks/threads_mix.py --child default

torch ships its own libgomp and Numba's "omp" layer loads the system one, so a torch process running
pagekv has two OpenMP pools whose idle workers spin (GOMP_SPINCOUNT) while the other pool works.
Each setup runs in a fresh process (the OpenMP runtimes read their settings when they load) and times
three torch linears alone, one pagekv decode alone, and both in sequence (the mix), in blocks of one
variant. ``mix ÷ parts`` above 1 is what the two pools cost each other.
"""

import argparse
import json
import os
import subprocess
import sys
import time

SETUPS = {
    # name: (environment for the whole process, GOMP_SPINCOUNT for Numba's pool only)
    "default (omp, spin unchanged)": ({}, None),
    "OMP_WAIT_POLICY=PASSIVE (both pools)": ({"OMP_WAIT_POLICY": "PASSIVE"}, None),
    "GOMP_SPINCOUNT=10000 (both pools)": ({"GOMP_SPINCOUNT": "10000"}, None),
    "GOMP_SPINCOUNT=10000 (Numba's pool only)": ({}, "10000"),
    "GOMP_SPINCOUNT=0 (Numba's pool only)": ({}, "0"),
    "NUMBA_THREADING_LAYER=workqueue": ({"NUMBA_THREADING_LAYER": "workqueue"}, None),
}


def child(numba_spin):
    import numpy as np
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
    weight, x = torch.randn(1024, 1024), torch.randn(seqs, 1024)

    def torch_part():
        for _ in range(3):
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
    args = parser.parse_args()
    if args.child:
        child(SETUPS[args.child][1])
        return
    print("| setup | threads (torch / Numba) | torch ms | pagekv ms | mix ms | mix ÷ parts |")
    print("|---|---|---|---|---|---|")
    for name, (env, _) in SETUPS.items():
        result = subprocess.run([sys.executable, __file__, "--child", name], check=True,
                                capture_output=True, text=True, env={**os.environ, **env})
        r = json.loads(result.stdout)
        print(f"| {name} | {r['torch_threads']} / {r['numba_threads']} ({r['layer']}) | {r['torch']:.3f} "
              f"| {r['pagekv']:.3f} | {r['mix']:.3f} | {r['mix'] / (r['torch'] + r['pagekv']):.2f} |")


if __name__ == "__main__":
    main()
