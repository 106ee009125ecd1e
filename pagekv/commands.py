"""What each ``pagekv`` subcommand does (argument parsing lives in cli.py)."""

import json
import os
import sys
import time

import numpy as np

from pagekv import trace as traces
from pagekv.models import PRESETS
from pagekv.sim import SimConfig, simulate as run_policy

__all__ = ["CommandError", "simulate", "plan", "bench", "info"]


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


_MAX_SLOTS = 2**31 - 1  # the most tokens one pool addresses (int32 slots, int32 page ids)


def _gib(nbytes):
    return f"{nbytes / 2**30:.2f} GiB"


def _table(header, rows):
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).rjust(w) for x, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- simulate
def simulate(args, model_of):
    model = model_of(args)
    try:
        if args.synthetic:
            requests = traces.synthetic_trace(num_requests=args.num_requests, rate=args.rate,
                                              seed=args.seed)
            source = f"synthetic ({args.num_requests} requests, {args.rate}/s, seed {args.seed})"
        elif args.trace:
            requests = traces.load_trace(args.trace, limit=args.limit)
            source = args.trace
        else:
            requests = traces.default_trace()[:args.limit]
            source = "embedded Mooncake conversation slice (first 300 requests, Apache-2.0)"
    except OSError as exc:
        raise CommandError(f"cannot read the trace: {exc}") from None
    except traces.TraceError as exc:
        raise CommandError(str(exc)) from None
    if not requests:
        raise CommandError("expected at least one request in the trace, got none")
    config = SimConfig(model=model, memory_bytes=args.memory, page_size=args.page_size,
                       dtype=args.dtype, max_seqs=args.max_seqs, max_new_tokens=args.max_new_tokens,
                       swap_memory_bytes=args.swap_memory, spill_prefixes=args.spill_prefixes)
    if config.num_pages < 1:
        raise CommandError(f"expected a budget of at least one page ({config.spec.bytes_per_page} B), "
                           f"got {args.memory} B")
    # The page tables hold int32 slots (page * page_size + offset) and a pool at most 2**31 - 1 pages.
    for option, nbytes, limit in (("--memory", args.memory, _MAX_SLOTS),
                                  ("--swap-memory", args.swap_memory, _MAX_SLOTS * args.page_size)):
        used = option == "--memory" or "paged+swap" in args.policies
        if used and config.spec.pages_for_budget(nbytes) * args.page_size > limit:
            largest = limit // args.page_size * config.spec.bytes_per_page
            raise CommandError(f"expected {option} of at most {_gib(largest)} ({limit:,} tokens of "
                               f"{model.name}'s KV), got {_gib(nbytes)}")
    print(f"pagekv simulate: {len(requests)} requests from {source}")
    print(f"model {model.name} ({model.num_layers} layers, {model.num_kv_heads} KV heads, head_dim "
          f"{model.head_dim}, {args.dtype}): {config.spec.bytes_per_token} B per token; budget "
          f"{_gib(args.memory)} = {config.num_pages} pages of {args.page_size} tokens")
    if args.attention:  # compile (or load) the decode kernel now, not under the progress bar
        from pagekv.kernels import _warm

        _warm.run("decode", args.dtype, model.head_dim, args.page_size)
    bar = _progress(len(requests) * len(args.policies), disable=args.no_progress)
    results, kernel = [], {}
    for policy in args.policies:
        hook = _attention_hook(config, kernel.setdefault(policy, {})) \
            if args.attention and policy != "contiguous" else None
        results.append(run_policy(requests, config, policy, progress=bar.update, step_hook=hook))
    bar.close()
    print()
    print(_table(["policy", "done", "rejected", "preempted", "peak seqs", "mean seqs", "peak mem",
                  "mean mem", "frag", "prefix hit", "tok/s", "TTFT p50", "TTFT p99", "lat p50",
                  "lat p99"],
                 [[r.policy, r.completed, r.rejected, r.preemptions, r.peak_running,
                   f"{r.mean_running:.1f}", f"{r.peak_memory_fraction:.0%}",
                   f"{r.mean_memory_fraction:.0%}", f"{r.mean_fragmentation_fraction:.0%}",
                   f"{r.prefix_hit_rate:.0%}", f"{r.output_tokens_per_s:.0f}",
                   f"{r.ttft_p50:.2f}s", f"{r.ttft_p99:.2f}s", f"{r.latency_p50:.1f}s",
                   f"{r.latency_p99:.1f}s"] for r in results]))
    print("\nmem: share of the KV budget held by running sequences (reserved or paged); frag: share "
          "held but empty; prefix hit: prompt tokens served from cache; times are simulated "
          "(pagekv.sim.CostModel).")
    for r in results:
        if r.policy == "paged+swap":
            print(f"paged+swap: {r.swap_outs} of {r.preemptions} preemptions swapped to host memory instead "
                  f"of recomputed ({r.swap_out_bytes / 2**30:.2f} GiB out, {r.swap_in_bytes / 2**30:.2f} "
                  f"GiB in at {config.cost.swap_bandwidth_bytes_s / 1e9:.0f} GB/s); "
                  f"{r.swap_in_hidden_fraction:.0%} of swap-in time hidden behind compute")
            if config.spill_prefixes != "none":
                print(f"paged+swap: evicted prefix pages copied to host memory: "
                      f"{r.spilled_bytes / 2**30:.2f} GiB; copied back for prompts that hit them: "
                      f"{r.restored_bytes / 2**30:.2f} GiB")
    for policy, figures in kernel.items():
        if figures.get("calls"):
            seconds = figures["seconds"] / figures["calls"]
            print(f"decode kernel ({policy}, one layer, real pages): {seconds * 1e3:.2f} ms per step, "
                  f"{figures['bytes'] / figures['seconds'] / 1e9:.1f} GB/s over {figures['calls']} steps")
    if args.json:
        _dump_json(args.json, {"source": source, "model": vars(model), "memory_bytes": args.memory,
                              "page_size": args.page_size, "dtype": args.dtype,
                              "results": [r.as_dict() for r in results], "attention": kernel})
        print(f"wrote {args.json}")
    if args.plot:
        _plot(results, args.plot, title=f"{model.name}, {_gib(args.memory)} KV budget, {source}")
        print(f"wrote {args.plot}")
    return 0


def _dump_json(path, data):
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))
    except OSError as exc:  # the table above is printed already: only the file is lost
        raise CommandError(f"cannot write {path}: {exc.strerror}") from None


def _progress(total, *, disable):
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="req", desc="simulating", disable=disable, file=sys.stderr,
                leave=False)


def _attention_hook(config, figures, *, every=16):
    """Every ``every``-th decode step, run the real decode kernel over the step's page tables."""
    from pagekv import attention
    from pagekv.cache import KVCache

    spec = config.spec
    one_layer = type(spec)(num_layers=1, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                           page_size=spec.page_size, dtype=spec.dtype)
    cache = KVCache(one_layer, config.num_pages)
    rng = np.random.default_rng(0)
    if cache.data.dtype == np.float32:
        cache.data[...] = rng.random(cache.data.shape, dtype=np.float32)
    elif cache.data.dtype == np.uint8:  # random float8 patterns of magnitude 2**-3 .. 2 (no NaN)
        cache.data[...] = rng.integers(0x20, 0x40, cache.data.shape, dtype=np.uint8)
    else:  # random finite 16-bit patterns (exponent field below the inf/NaN range)
        cache.data.view(np.uint16)[...] = rng.integers(0x3000, 0x4000, cache.data.shape, dtype=np.uint16)
    group = 4  # query heads per KV head (the presets' GQA ratio; only the timing depends on it)
    figures.update(calls=0, seconds=0.0, bytes=0, steps=0)

    def hook(memory, seqs):
        figures["steps"] += 1
        if figures["steps"] % every:
            return
        batch = memory.m.batch(seqs)
        q = np.ones((len(seqs), spec.num_kv_heads * group, spec.head_dim), np.float32)
        start = time.perf_counter()
        attention.paged_decode_attention(q, cache.k(0), cache.v(0), batch.block_table, batch.seq_lens)
        figures["seconds"] += time.perf_counter() - start
        figures["calls"] += 1
        figures["bytes"] += int(batch.seq_lens.sum()) * spec.bytes_per_token // spec.num_layers

    return hook


def _plot(results, path, *, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError("--plot needs matplotlib: pip install 'pagekv[plot]'") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:  # a moving average over ~10 samples: the raw series is too jagged to read
        top.plot(r.timeline["t"], _smooth(np.array(r.timeline["memory"]) * 100), label=r.policy, lw=1.2)
        bottom.plot(r.timeline["t"], _smooth(np.array(r.timeline["running"], float)), label=r.policy,
                    lw=1.2)
    top.set_ylabel("KV budget held (%)")
    bottom.set_ylabel("running sequences")
    bottom.set_xlabel("simulated time (s)")
    top.legend(loc="upper right")
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CommandError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def _smooth(values, width=10):
    if len(values) < width:
        return values
    return np.convolve(values, np.ones(width) / width, mode="same")


# ------------------------------------------------------------------------------------- plan
def plan(args, model_of):
    model = model_of(args)
    spec = model.spec(page_size=args.page_size, dtype=args.dtype)
    pages = spec.pages_for_budget(args.memory)
    per_seq = spec.pages_for_tokens(args.context)
    contiguous = args.memory // (args.max_context * spec.bytes_per_token)
    print(f"model {model.name}: {model.num_layers} layers x {model.num_kv_heads} KV heads x head_dim "
          f"{model.head_dim}, {args.dtype}")
    print(f"  bytes per token     2 x {model.num_layers} x {model.num_kv_heads} x {model.head_dim} x "
          f"{spec.itemsize} = {spec.bytes_per_token:,}")
    print(f"  bytes per page      {spec.bytes_per_page:,} ({args.page_size} tokens)")
    print(f"  pages in {_gib(args.memory):>10}  {pages:,}")
    print(f"  sequences of {args.context:,} tokens that fit:")
    print(f"    paged             {pages // per_seq:,} ({per_seq} pages each, "
          f"{per_seq * args.page_size - args.context} slots unused per sequence)")
    print(f"    contiguous        {contiguous:,} (each reserves its maximum context of "
          f"{args.max_context:,} tokens)")
    note = PRESETS["llama-3-70b"].spec(dtype="bfloat16")
    print("\nThe design note's example, computed correctly (70B model, 128K context, bf16):")
    print(f"  KV cache = 131,072 tokens x {note.bytes_per_token:,} B = "
          f"{_gib(131072 * note.bytes_per_token)} — linear in tokens, not quadratic; the note's "
          "32 GB came from 2 x hidden x head_num, which is not the KV size of a GQA model.")
    return 0


# ------------------------------------------------------------------------------------- bench
def bench(args, model_of=None):
    from pagekv import PageAllocator, attention
    from pagekv.kernels import warmup
    from pagekv.kernels.bandwidth import stream_sum

    import numba

    print("pagekv bench: compiling or loading the kernels ...", flush=True)
    print(f"  kernels ready in {warmup():.1f} s")
    threads = numba.get_num_threads()
    data = np.ones(2**27, np.float32)
    stream_sum(data, threads)
    best = min(_timed(lambda: stream_sum(data, threads)) for _ in range(5))
    roof = data.nbytes / best / 1e9
    print(f"  streaming read ({threads} threads)      {roof:6.1f} GB/s")
    rng = np.random.default_rng(0)
    for kind in ("float32", "bfloat16"):
        num_seqs, length, pages = 16, 2048, 16 * 128
        k, v = rng.standard_normal((2, pages, 8, 16, 128), dtype=np.float32)
        if kind == "bfloat16":
            k, v = ((x.view(np.uint32) >> 16).astype(np.uint16) for x in (k, v))
        table = rng.permutation(pages).astype(np.int32).reshape(num_seqs, 128)
        lens = np.full(num_seqs, length, np.int32)
        q = rng.standard_normal((num_seqs, 32, 128), dtype=np.float32)
        plan_ = attention.plan_decode(lens, page_size=16)
        out = np.empty_like(q)
        run = (lambda: attention.paged_decode_attention(q, k, v, table, lens, plan=plan_, out=out))
        run()
        # Each decode timed next to a roof: the host's bandwidth drifts between runs (README,
        # Benchmarks).
        rounds = [(_timed(lambda: stream_sum(data, threads)), _timed(run)) for _ in range(7)]
        gbs = (k.nbytes + v.nbytes) / np.median([t for _, t in rounds]) / 1e9
        share = np.median([(k.nbytes + v.nbytes) / t / (data.nbytes / r) for r, t in rounds])
        print(f"  decode S1 {kind:8s} (paged, random)   {gbs:6.1f} GB/s = {share:4.0%} of the read "
              "roof timed beside it")
    alloc = PageAllocator(2**14)
    alloc.allocate(2**13)
    rounds = 20000
    start = time.perf_counter()
    for _ in range(rounds):
        alloc.decref(alloc.allocate(16))
    per_page = (time.perf_counter() - start) / (rounds * 16) * 1e9
    print(f"  allocator, 16-page allocate+decref  {per_page:6.1f} ns per page")
    return 0


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ------------------------------------------------------------------------------------- info
def _bf16_path(features):
    """How this process multiplies bfloat16 pages, in words (the kernels choose per call)."""
    from pagekv.attention import BF16_PRODUCTS
    from pagekv.kernels import _amx, amx_attention

    if _amx.AVAILABLE:
        low, high = amx_attention.DECODE_GROUPS
        return (f"AMX tiles for prefill, and for decode with GQA groups of {low}-{high} query heads "
                f"per KV head ({amx_attention.WIDE_MIN_GROUP}-{high} above head_dim "
                f"{amx_attention.WIDE_HEAD_DIM}); vdpbf16ps otherwise (PAGEKV_AMX=0 turns AMX off)")
    off = ""
    if features.get("amx-bf16"):
        off = (" (AMX off: PAGEKV_AMX=0)" if os.environ.get("PAGEKV_AMX") == "0"
               else " (the CPU has AMX, but this OS did not grant its tile state)")
    if BF16_PRODUCTS:
        return f"vdpbf16ps (AVX512-BF16) products, float32 sums{off}"
    return "rows widened to float32 as they load (no AVX512-BF16)"


def info(args, model_of=None):
    import importlib.metadata
    import pathlib
    import platform

    import llvmlite.binding as llvm  # type: ignore[import-untyped]
    import numba

    import pagekv.kernels
    from pagekv.kernels import _cache_dir, threads

    threads.start()  # as a kernel call would (pagekv/kernels/threads.py: why nesting is off)
    versions = {name: importlib.metadata.version(name)
                for name in ("pagekv", "numpy", "numba", "llvmlite")}
    print(f"python     {platform.python_version()} ({platform.machine()}, {platform.system()})")
    for name, version in versions.items():
        print(f"{name:10s} {version}")
    print(f"threads    {numba.get_num_threads()} (NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}; "
          f"{os.cpu_count()} CPUs)")
    openmp = threads.numba_libgomp() if numba.threading_layer() == "omp" else None
    nesting = "" if openmp is None else f"; GNU OpenMP, {openmp.omp_get_max_active_levels()} active level(s)"
    print(f"threading  {numba.threading_layer()} layer (NUMBA_THREADING_LAYER="
          f"{numba.config.THREADING_LAYER}){nesting}")
    features = llvm.get_host_cpu_features()
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bf16", "neon", "sve"]
    print(f"cpu        {llvm.get_host_cpu_name()}: "
          + " ".join(f for f in wanted if features.get(f, False)))
    print(f"bfloat16   {_bf16_path(features)}")
    cache_dir = _cache_dir.kernels_cache(pathlib.Path(pagekv.kernels.__file__).parent)
    cached = sorted(p.stem.split(".")[0] for p in cache_dir.glob("*.nbi")) if cache_dir.exists() else []
    print(f"cache      {cache_dir}")
    print(f"compiled   {', '.join(sorted(set(cached))) if cached else 'nothing yet (pagekv bench or pagekv.kernels.warmup() compiles)'}")
    return 0

