"""A continuous-batching serving simulator that drives the real KVCacheManager.

Four KV-memory policies replay the same trace under the same budget:

- ``contiguous``: each admitted request reserves one contiguous extent for its maximum context
  (prompt + ``max_new_tokens``), first fit in a linear address space — the allocation the design
  note starts from, with its external fragmentation;
- ``paged``: pages on demand from :class:`pagekv.KVCacheManager`, prefix caching off;
- ``paged+prefix``: the same with prefix caching on;
- ``paged+swap``: ``paged+prefix`` whose preemptions swap a sequence's pages to a host tier
  (``SimConfig.swap_memory_bytes``) instead of recomputing it, whenever the round trip over the
  host link costs less than the recompute and other sequences stay running; a swapped sequence
  resumes (before new admissions) when its pages fit again, its swap-in issued one step ahead so it
  overlaps that step's compute. As in ``TieredKVCache``, full pages the prefix cache holds do not
  cross at swap-out unless they are evicted before the sequence resumes, and those still cached
  then (a shared system prompt) are shared again instead of copied back. The host tier is also a
  second-level prefix cache (``SimConfig.spill_prefixes``, as ``TieredKVCache``'s): pages the hot
  prefix cache evicts are copied to it (by default only those a prompt hit while hot), and an
  admitted prompt's pages found there are copied back instead of recomputed.

The loop: requests arrive by timestamp and wait in FCFS order; a request is admitted while its
prompt's memory can be had; each step prefills up to ``prefill_chunk`` prompt tokens (chunked
prefill) and decodes one token for every sequence whose prefill is done; a finished sequence frees
its memory; when a decode step cannot get its pages, the most recently admitted sequence is
preempted (its memory freed, the request requeued at the front to be recomputed from its prompt and
the tokens generated so far). Time is simulated by :class:`CostModel`, so runs are deterministic.
"""

import bisect
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from pagekv.errors import OutOfPagesError
from pagekv.manager import KVCacheManager
from pagekv.models import MAX_CONTEXT
from pagekv.setaside import SetAside
from pagekv.spill import PrefixSpill
from pagekv.tier import TierPages
from pagekv.trace import prompt_tokens

__all__ = ["CostModel", "SimConfig", "PolicyResult", "simulate", "POLICIES"]

POLICIES = ("contiguous", "paged", "paged+prefix", "paged+swap")


@dataclass(frozen=True)
class CostModel:
    """Simulated time of one step (a fixed, documented model of one accelerator):

    ``step = overhead + weights / bandwidth + kv_read / bandwidth + prefill_tokens * 2 * params / flops``

    where ``weights`` are the model's bytes (read once per step), ``kv_read`` the KV bytes of every
    decoding sequence's context (read once per step), and prefill costs its FLOPs at ``flops``.
    """

    overhead_s: float = 0.002
    bandwidth_bytes_s: float = 2.0e12
    flops: float = 4.0e14
    swap_bandwidth_bytes_s: float = 5.0e10  # device <-> host link (PCIe 5.0 x16), each way

    def swap_seconds(self, nbytes):
        return nbytes / self.swap_bandwidth_bytes_s

    def recompute_seconds(self, num_tokens, num_params):
        return num_tokens * 2.0 * num_params / self.flops

    def step_seconds(self, *, weight_bytes, kv_bytes, prefill_tokens, num_params):
        if kv_bytes == 0 and prefill_tokens == 0:
            return 0.0
        return (self.overhead_s + (weight_bytes + kv_bytes) / self.bandwidth_bytes_s
                + prefill_tokens * 2.0 * num_params / self.flops)


@dataclass(frozen=True)
class SimConfig:
    """What is simulated: model, KV budget and serving limits."""

    model: object                   # pagekv.models.ModelShape
    memory_bytes: int
    page_size: int = 16
    dtype: str = "bfloat16"
    max_seqs: int = 256
    max_new_tokens: int = 2048
    prefill_chunk: int = 8192
    swap_memory_bytes: int = 64 * 2**30   # the host tier of "paged+swap"
    spill_prefixes: str = "reused"        # "paged+swap": which evicted prefix pages the tier keeps
    cost: CostModel = field(default_factory=CostModel)

    @property
    def spec(self):
        return self.model.spec(page_size=self.page_size, dtype=self.dtype)

    @property
    def num_pages(self):
        return self.spec.pages_for_budget(self.memory_bytes)


@dataclass
class PolicyResult:
    """Every figure of one policy's run (JSON-ready through :meth:`as_dict`)."""

    policy: str
    completed: int = 0
    rejected: int = 0
    preemptions: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    peak_memory_fraction: float = 0.0
    mean_memory_fraction: float = 0.0
    mean_fragmentation_fraction: float = 0.0
    prefix_hit_rate: float = 0.0
    simulated_seconds: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    latency_p50: float = 0.0
    latency_p99: float = 0.0
    swap_outs: int = 0
    swap_out_bytes: int = 0
    swap_in_bytes: int = 0
    swap_in_hidden_fraction: float = 0.0   # of swap-in time, overlapped with compute
    spilled_bytes: int = 0                 # evicted prefix pages copied to the host tier
    restored_bytes: int = 0                # and copied back on a prompt's hit
    timeline: dict = field(default_factory=lambda: {"t": [], "memory": [], "running": []})

    def as_dict(self):
        return asdict(self)


# ----------------------------------------------------------------------------- memory policies
class _ContiguousMemory:
    """First-fit extents of whole maximum contexts in a linear token space."""

    def __init__(self, config):
        self.capacity = config.num_pages * config.page_size   # tokens that fit in the budget
        self.free = [(0, self.capacity)]                      # sorted (start, length) extents
        self.extents = {}                                     # seq -> (start, length)
        self.max_new = config.max_new_tokens
        self.tokens = {}

    def fits_ever(self, num_tokens):
        return num_tokens + self.max_new <= self.capacity

    def admit(self, seq, tokens, output_length):
        need = len(tokens) + self.max_new  # the server cannot know the output length in advance
        for i, (start, length) in enumerate(self.free):
            if length >= need:
                self.free[i:i + 1] = [(start + need, length - need)] if length > need else []
                self.extents[seq] = (start, need)
                self.tokens[seq] = len(tokens)
                return 0
        return None

    def decode(self, seqs):
        for s in seqs:
            self.tokens[s] += 1  # inside the reservation: never fails
        return True

    def release(self, seq):
        start, length = self.extents.pop(seq)
        del self.tokens[seq]
        i = bisect.bisect(self.free, (start, length))
        self.free.insert(i, (start, length))
        # coalesce with the neighbours
        if i + 1 < len(self.free) and start + length == self.free[i + 1][0]:
            self.free[i:i + 2] = [(start, length + self.free[i + 1][1])]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == self.free[i][0]:
            self.free[i - 1:i + 1] = [(self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])]

    def usage(self):
        """(memory in use, memory in use but holding no token), as fractions of the budget."""
        stored = sum(self.tokens.values())
        reserved = sum(length for _, length in self.extents.values())
        return reserved / self.capacity, (reserved - stored) / self.capacity

    def hit_rate(self):
        return 0.0


class _PagedMemory:
    """Pages on demand from the real KVCacheManager."""

    def __init__(self, config, *, prefix, swap=False):
        self.page_size = config.page_size
        self.bytes_per_page = config.spec.bytes_per_page
        tier_pages = config.spec.pages_for_budget(config.swap_memory_bytes) if swap else 0
        self.tier = TierPages(tier_pages) if tier_pages else None  # bookkeeping only: no KV data
        self.max_pages = -(-(MAX_CONTEXT + config.max_new_tokens) // config.page_size)
        self.m = KVCacheManager(num_pages=config.num_pages, page_size=config.page_size,
                                max_seqs=config.max_seqs, max_pages_per_seq=self.max_pages,
                                enable_prefix_caching=prefix)
        self.capacity_pages = config.num_pages
        # a swapped sequence's cached full pages stay hot, copied to the tier only if they leave
        # the hot cache first, and evicted prefix pages are kept in the tier (as TieredKVCache
        # does); no KV data, so the copies are only counted
        self.set_aside = self.spill = None
        self._counted = (0, 0, 0)
        if self.tier is not None and prefix:
            self.set_aside = SetAside(self.m, self.tier.allocator, _no_copy)
            self.spill = PrefixSpill(self.m, self.tier, self.set_aside, copy_out=_no_copy,
                                     copy_in=_no_copy, policy=config.spill_prefixes)
            self.m.on_evict, self.m.on_clear = self.spill.evicted, self.spill.cleared

    def fits_ever(self, num_tokens):
        pages = -(-(num_tokens + 1) // self.page_size)
        return pages <= min(self.capacity_pages, self.max_pages)

    def admit(self, seq, tokens, output_length):
        # Keep a page of headroom per running sequence, so admission does not starve decoding.
        need = -(-len(tokens) // self.page_size) + len(self.m)
        stats = self.m.stats()
        if need > stats.pages_free + stats.pages_cached:
            return None
        if self.spill is not None:  # its pages in the tier come back first, as hits
            self.spill.restore(tokens)
        try:
            return self.m.add_sequence(seq, tokens)
        except OutOfPagesError:
            return None

    def decode(self, seqs):
        try:
            self.m.append_tokens(seqs, np.zeros(len(seqs), np.int32))
            self.m.take_pending_copies()  # no KV data is simulated: nothing to copy
            return True
        except OutOfPagesError:
            return False

    def release(self, seq):
        self.m.free(seq)

    def swap_pages(self, seq):
        """Pages a swap of ``seq`` moves, or None when there is no tier room for them."""
        pages = len(self.m.page_table(seq))
        return pages if self.tier is not None and pages <= self.tier.room() else None

    def swap_out(self, seq):
        """Detach ``seq`` onto tier pages; returns what swap_in needs and the pages copied now."""
        table = self.m.page_table(seq)
        _, keys, known = self.set_aside.plan(table)
        tier_pages = self.set_aside.tier_pages(keys, known, self.tier.take(int((~known).sum())))
        if known.any():  # one tier reference per sequence using a page set aside already
            self.tier.allocator.incref(tier_pages[known])
        return (self.m.detach(seq), tier_pages), sum(key is None for key in keys)

    def tier_traffic(self):
        """Pages moved since the last call: (set aside at swap-out and copied to the tier as they
        left the hot cache, spilled to the tier as they were evicted, restored from it)."""
        counts = (self.set_aside.pages_copied if self.set_aside else 0,
                  self.spill.pages_spilled if self.spill else 0,
                  self.spill.pages_restored if self.spill else 0)
        moved = tuple(now - before for now, before in zip(counts, self._counted))
        self._counted = counts
        return moved

    def swap_in(self, seq, swapped):
        """Attach a swapped sequence again if its pages (and a page of headroom per running
        sequence) can be had. Returns the pages copied back, or None when it could not: full
        pages the prefix cache still holds are shared again instead (as TieredKVCache.prefetch)."""
        record, tier_pages = swapped
        if -(-record.num_tokens // self.page_size) + len(self.m) > self.m.pages_obtainable() \
                or not self.m.free_rows:
            return None
        _, fresh = self.m.attach(seq, record, reuse_cached=True)
        self.set_aside.bring_in(tier_pages[fresh])
        self.set_aside.let_go(tier_pages)
        return int(fresh.sum())

    def usage(self):
        """(pages held by sequences, their empty slots), as fractions of the budget."""
        stats = self.m.stats()
        in_use = (stats.pages_used - stats.pages_cached) / self.capacity_pages
        return in_use, stats.fragmentation_tokens / (self.capacity_pages * self.page_size)

    def hit_rate(self):
        stats = self.m.stats()
        return stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0


def _no_copy(src, dst):
    """The simulator moves no KV: copies are only counted."""


# ----------------------------------------------------------------------------- the serving loop
class _Running:
    __slots__ = ("rid", "seq", "prompt", "to_prefill", "generated", "admitted", "first_token", "resuming")

    def __init__(self, rid, seq, prompt, cached, generated):
        self.rid, self.seq, self.prompt = rid, seq, prompt
        self.to_prefill = len(prompt) - cached
        self.generated = generated
        self.admitted = 0.0
        self.first_token = None
        self.resuming = False  # swapped in this step: its KV arrives while the step computes


def simulate(requests, config, policy, *, progress=None, step_hook=None):
    """Replay ``requests`` under ``policy``; returns a :class:`PolicyResult`.

    Parameters
    ----------
    requests : list of pagekv.trace.Request, sorted by arrival
    config : SimConfig
    policy : one of POLICIES
    progress : callable(int), optional
        Called with the number of requests finished (completed or rejected) since the last call.
    step_hook : callable(memory, decode_seqs), optional
        Called after each decode step (``--attention`` runs the real kernel there).
    """
    if policy not in POLICIES:
        raise ValueError(f"expected a policy in {POLICIES}, got {policy!r}")
    memory = (_ContiguousMemory(config) if policy == "contiguous"
              else _PagedMemory(config, prefix=policy != "paged", swap=policy == "paged+swap"))
    spec = config.spec
    weight_bytes = config.model.num_params * spec.itemsize
    result = PolicyResult(policy)
    pending = deque(enumerate(requests))        # not yet arrived
    waiting = deque()                           # arrived: (rid, extra generated tokens)
    running: list[_Running] = []
    swapped: deque = deque()                    # preempted by swap: (entry, swap record), FCFS
    swap_in_seconds = swap_in_hidden = 0.0
    arrival = {rid: r.arrival for rid, r in enumerate(requests)}
    ttft, latency = [], []
    now, next_seq, generated_total = 0.0, 0, 0
    running_sum = memory_sum = frag_sum = 0.0
    steps = 0
    head = (None, None, None)  # (rid, generated, prompt) of the waiting queue's head

    def finish(count=1):
        if progress:
            progress(count)

    while pending or waiting or running or swapped:
        if not waiting and not running and not swapped and pending[0][1].arrival > now:
            now = pending[0][1].arrival
        while pending and pending[0][1].arrival <= now:
            rid, request = pending.popleft()
            waiting.append((rid, 0))
        # swapped sequences resume first (FCFS); while one waits, nothing new is admitted
        swap_in_now = 0.0
        while swapped and len(running) < config.max_seqs and \
                (copied := memory.swap_in(swapped[0][0].seq, swapped[0][1])) is not None:
            entry, _ = swapped.popleft()
            entry.resuming = True
            running.append(entry)
            nbytes = copied * memory.bytes_per_page
            result.swap_in_bytes += nbytes
            swap_in_now += config.cost.swap_seconds(nbytes)
        # admission, FCFS
        while waiting and not swapped and len(running) < config.max_seqs:
            rid, done = waiting[0]
            request = requests[rid]
            if head[:2] != (rid, done):  # the head often waits many steps: build its prompt once
                prompt = prompt_tokens(request)
                if done:  # recompute after preemption: the prompt grows by the tokens generated
                    prompt = np.concatenate([prompt, np.zeros(done, np.int32)])
                head = (rid, done, prompt)
            prompt = head[2]
            if not memory.fits_ever(len(prompt)):
                waiting.popleft()
                result.rejected += 1
                finish()
                continue
            cached = memory.admit(next_seq, prompt, request.output_length)
            if cached is None:
                break
            waiting.popleft()
            entry = _Running(rid, next_seq, prompt, cached, done)
            entry.admitted = now
            running.append(entry)
            next_seq += 1
        # chunked prefill
        budget = config.prefill_chunk
        prefill_tokens = 0
        for entry in running:
            if entry.to_prefill and budget:
                take = min(entry.to_prefill, budget)
                entry.to_prefill -= take
                budget -= take
                prefill_tokens += take
        # decode one token for every prefilled sequence; preempt the newest on a page shortage
        decoding = [e for e in running if not e.to_prefill and not e.resuming]
        serial_copies = 0.0
        while decoding and not memory.decode([e.seq for e in decoding]):
            victim = running.pop()
            result.preemptions += 1
            # swapping helps the sequences left running; a victim running alone gains nothing by it
            pages = memory.swap_pages(victim.seq) if policy == "paged+swap" and running else None
            nbytes = (pages or 0) * memory.bytes_per_page
            recompute = config.cost.recompute_seconds(len(victim.prompt) + victim.generated,
                                                      config.model.num_params)
            if pages is not None and 2 * config.cost.swap_seconds(nbytes) < recompute:
                victim.resuming = False
                record, copied = memory.swap_out(victim.seq)
                swapped.append((victim, record))
                result.swap_outs += 1
                result.swap_out_bytes += copied * memory.bytes_per_page
                serial_copies += config.cost.swap_seconds(copied * memory.bytes_per_page)  # before reuse
            else:
                memory.release(victim.seq)
                waiting.appendleft((victim.rid, victim.generated))
            decoding = [e for e in running if not e.to_prefill and not e.resuming]
        if policy == "paged+swap":  # copies at eviction and admission, before the step computes
            late, spilled, restored = (pages * memory.bytes_per_page for pages in memory.tier_traffic())
            result.swap_out_bytes += late
            result.spilled_bytes += spilled
            result.restored_bytes += restored
            serial_copies += config.cost.swap_seconds(late + spilled + restored)
        kv_tokens = sum(len(e.prompt) + e.generated for e in decoding)
        dt = config.cost.step_seconds(weight_bytes=weight_bytes if (decoding or prefill_tokens) else 0,
                                      kv_bytes=kv_tokens * spec.bytes_per_token,
                                      prefill_tokens=prefill_tokens, num_params=config.model.num_params)
        if step_hook and decoding:
            step_hook(memory, [e.seq for e in decoding])
        # a swap-in issued this step overlaps its compute; what does not fit delays the next step
        swap_in_seconds += swap_in_now
        swap_in_hidden += min(swap_in_now, dt)
        dt += serial_copies + max(0.0, swap_in_now - dt)
        for entry in running:
            entry.resuming = False
        now += dt
        still = []
        decoded = set(map(id, decoding))
        for entry in running:
            if id(entry) in decoded:
                entry.generated += 1
                generated_total += 1
                if entry.first_token is None:
                    entry.first_token = now
                    ttft.append(now - arrival[entry.rid])
            if entry.generated >= min(requests[entry.rid].output_length, config.max_new_tokens):
                memory.release(entry.seq)
                latency.append(now - arrival[entry.rid])
                result.completed += 1
                finish()
            else:
                still.append(entry)
        running = still
        used, fragmentation = memory.usage()
        steps += 1
        running_sum += len(running)
        memory_sum += used
        frag_sum += fragmentation
        result.peak_running = max(result.peak_running, len(running))
        result.peak_memory_fraction = max(result.peak_memory_fraction, used)
        if steps % 8 == 0:
            result.timeline["t"].append(round(now, 4))
            result.timeline["memory"].append(round(used, 5))
            result.timeline["running"].append(len(running))

    result.simulated_seconds = now
    result.mean_running = running_sum / steps if steps else 0.0
    result.mean_memory_fraction = memory_sum / steps if steps else 0.0
    result.mean_fragmentation_fraction = frag_sum / steps if steps else 0.0
    result.prefix_hit_rate = memory.hit_rate()
    result.swap_in_hidden_fraction = swap_in_hidden / swap_in_seconds if swap_in_seconds else 0.0
    result.output_tokens_per_s = generated_total / now if now else 0.0
    if ttft:
        result.ttft_p50, result.ttft_p99 = (float(x) for x in np.percentile(ttft, [50, 99]))
    if latency:
        result.latency_p50, result.latency_p99 = (float(x) for x in np.percentile(latency, [50, 99]))
    if isinstance(memory, _PagedMemory):
        for entry in running:
            memory.release(entry.seq)
        memory.m.clear_prefix_cache()
        memory.m.check()
        if memory.tier is not None:
            memory.tier.evict_prefixes(len(memory.tier.prefixes))
        if memory.m.allocator.num_free != memory.m.allocator.num_pages or \
                (memory.tier is not None and memory.tier.allocator.num_free != memory.tier.allocator.num_pages):
            raise RuntimeError("pages leaked during the simulation")
    return result
