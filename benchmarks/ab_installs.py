"""Two versions of pagekv timed against each other: one process each, taking turns call by call.

    pip install --no-deps --target /tmp/old-site <a checkout of the old commit>
    python benchmarks/ab_installs.py /tmp/old-site [--new-site DIR] [--shapes S1 S2] \
        [--kinds bfloat16 float32] [--rounds 31] [--from-cache | --prefill [TOKENS]]

A kernel change is judged by its time against the code before it on the same machine, minutes
apart at most: this project's VMs move a decode's share of the roof by 10-20 points from one run
to the next (docs/performance.md), more than most changes do. Each version runs in its own
Python (its own Numba cache and compiled extension): the old one imports pagekv from OLD_SITE,
the new one from --new-site or, without it, the pagekv this Python has installed. In every round
both workers time one call each, the order alternating round by round, every timed decode or
prefill after an untimed pass over 512 MiB (the last-level cache evicted, as the attention
benchmark does), or with --from-cache every logical page mapped onto 512 KiB of physical pages
(the arithmetic with no memory traffic). Prints, per shape and KV dtype, the median of the rounds'
new ÷ old time ratios and its interquartile range: below 1 the new version is faster.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from attention_cases import PREFILL_TOKENS

HERE = os.path.dirname(os.path.abspath(__file__))
RESIDENT_BYTES = 512 * 1024  # as prefetch_study.py's "from cache"


def worker():
    """Serve one version's timings: read a JSON request per line, answer with one JSON line."""
    import time

    from attention_cases import pagekv_decode, pagekv_prefill, problem, streaming_read

    evict, _ = streaming_read()
    run = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "setup":
            p = problem(request["shape"], request["kind"])
            if request["prefill"] is not None:
                run = pagekv_prefill(p, q_len=request["prefill"])
            else:
                resident = RESIDENT_BYTES // p.k_cache[0].nbytes if request["from_cache"] else None
                run = pagekv_decode(p, resident_pages=resident)
            run()  # compiled (or loaded) and its pages touched before any timed call
            reply = {"ready": True}
        elif request["op"] == "where":
            import pagekv

            reply = {"pagekv": os.path.dirname(pagekv.__file__)}
        else:
            if not request["from_cache"]:
                evict()
            start = time.perf_counter()
            run()
            reply = {"seconds": time.perf_counter() - start}
        print(json.dumps(reply), flush=True)


def start_worker(site):
    """A worker process importing pagekv from ``site`` (None: this Python's own install)."""
    path = [HERE, site, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(entry for entry in path if entry))
    # OpenMP's threads spin for a while after each parallel call, and here they would spin on the
    # cores the other worker is being timed on: timing a version against itself from cache, the
    # rounds' new / old ratios spread over 0.73-1.31 (interquartile) with the default wait policy
    # and 0.93-1.07 with passive waits (Zen 4 VM, 2 cores). Both workers wait alike.
    env.setdefault("OMP_WAIT_POLICY", "passive")
    return subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)


def ask(processes, **request):
    """Send ``request`` to every worker at once (they compile side by side), then read each reply."""
    for process in processes:
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
    replies = []
    for process in processes:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker died (exit status {process.wait()})")
        replies.append(json.loads(line))
    return replies


def compare(workers, shape, kind, rounds, *, from_cache, prefill):
    """New ÷ old time of each round (float64 [rounds])."""
    ask(workers, op="setup", shape=shape, kind=kind, from_cache=from_cache, prefill=prefill)
    seconds = np.empty((rounds, 2))
    for i in range(rounds):
        for column in ((0, 1) if i % 2 == 0 else (1, 0)):
            seconds[i, column] = ask([workers[column]], op="time", from_cache=from_cache)[0]["seconds"]
    return seconds[:, 1] / seconds[:, 0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old_site", help="folder holding the old version's pagekv package")
    parser.add_argument("--new-site", help="folder holding the new version (default: the installed one)")
    parser.add_argument("--shapes", nargs="+", default=["S1", "S2", "S3"], metavar="SHAPE",
                        help="shapes of benchmarks/attention_cases.py (default: S1 S2 S3)")
    parser.add_argument("--kinds", nargs="+", default=["bfloat16", "float32"], metavar="DTYPE")
    parser.add_argument("--rounds", type=int, default=31, help="calls timed per version and case")
    parser.add_argument("--from-cache", action="store_true",
                        help="map every page onto 512 KiB (decode only): compute without memory traffic")
    parser.add_argument("--prefill", type=int, nargs="?", const=PREFILL_TOKENS, metavar="TOKENS",
                        help="time a chunked prefill of TOKENS new tokens per sequence (default "
                             f"{PREFILL_TOKENS}, as attention_cases.py) instead of decode")
    args = parser.parse_args(argv)
    for site in (args.old_site, args.new_site):
        # a folder without pagekv would silently time the installed version against itself
        if site is not None and not os.path.isdir(os.path.join(site, "pagekv")):
            parser.error(f"expected a folder holding a pagekv package, got {site!r}")
    if args.prefill is not None and args.prefill < 1:
        parser.error(f"expected --prefill a positive number of tokens, got {args.prefill}")
    if args.prefill is not None and args.from_cache:
        parser.error("expected --from-cache or --prefill, got both (--from-cache is decode only)")
    workers = [start_worker(args.old_site), start_worker(args.new_site)]
    try:
        old, new = (reply["pagekv"] for reply in ask(workers, op="where"))
        print(f"old: {old}\nnew: {new}\n")
        print("| shape | KV dtype | new ÷ old time, median | interquartile range |")
        print("|---|---|---|---|")
        for shape in args.shapes:
            for kind in args.kinds:
                ratios = compare(workers, shape, kind, args.rounds, from_cache=args.from_cache,
                                 prefill=args.prefill)
                low, median, high = np.percentile(ratios, [25, 50, 75])
                print(f"| {shape} | {kind} | {median:.3f} | {low:.3f}-{high:.3f} |", flush=True)
    finally:
        for process in workers:
            process.stdin.close()
            process.wait()
            process.stdout.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
