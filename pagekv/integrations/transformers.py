"""Hugging Face transformers on pagekv pages: ``generate`` with a paged KV cache and paged attention.

Three extension points of transformers 5.x (read from its source) carry the integration:

1. :class:`PagedCache`, a ``transformers.Cache`` passed as the model's cache: each layer's
   ``update`` writes the new keys and values into pagekv pages (``write_kv``) and hands the layer's
   page pool on, never a dense history;
2. an attention function registered as ``"pagekv"`` in ``transformers.AttentionInterface``: it runs
   ``paged_decode_attention`` / ``paged_prefill_attention`` straight over those pages;
3. a forward pre-hook on the model's base model, which sees each forward's ``input_ids`` and 2-D
   ``attention_mask``: it grows the page tables (token ids feed the prefix cache; padding gets no
   page) and hands the forward's tables to the attention function as a keyword argument
   (transformers passes a forward's extra keyword arguments down to the attention function).

Examples
--------
>>> pool = PagedKVPool(model, num_pages=1024)                         # doctest: +SKIP
>>> out = pool.generate(**tokenizer(prompts, return_tensors="pt", padding=True),
...                     max_new_tokens=32, do_sample=False)           # doctest: +SKIP
>>> pool.stats().prefix_hit_tokens                                    # doctest: +SKIP
"""

import inspect
import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch  # type: ignore[import-not-found, unused-ignore]  # the extra: torch
from transformers import AttentionInterface  # type: ignore[import-not-found, unused-ignore]
from transformers.cache_utils import Cache  # type: ignore[import-not-found, unused-ignore]

from pagekv._arrays import torch_zeros_on_line
from pagekv.attention import (
    copy_pages,
    paged_decode_attention,
    paged_prefill_attention,
    plan_decode,
    write_kv,
)
from pagekv.cache import KVCache, check_fits_in_memory
from pagekv.errors import PagekvError
from pagekv.manager import KVCacheManager, ManagerStats
from pagekv.prefix import check_cache_salt
from pagekv.spec import KVCacheSpec, pool_shape

__all__ = ["ATTENTION", "PagedKVPool", "PagedCache", "paged_attention", "register"]

ATTENTION = "pagekv"  # the name of pagekv's attention in transformers' AttentionInterface
_STEP = "pagekv_step"  # the forward keyword that carries a forward's page tables to the attention
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_PAGE_DTYPES = {name: dtype for dtype, name in _DTYPES.items()} | {"float8_e4m3fn": torch.float8_e4m3fn}


@dataclass
class _Step:
    """One forward's page tables, shared by every layer of that forward.

    Attributes
    ----------
    block_table : int32 [batch, max_pages]
        Page tables of the batch rows, cut to the pages the longest row uses.
    seq_lens : int32 [batch]
        Tokens of each row in the cache after this forward's tokens are written.
    slot_mapping : int32 [batch * q_len]
        Where each new token's K/V goes; -1 for a padding token and for a token whose page came
        from the prefix cache (its K/V is already there).
    query_rows : int64 [num_real_tokens] or None
        Rows of the flattened ``[batch * q_len]`` queries that are real tokens (None: all are).
    qo_indptr : int32 [batch + 1] or None
        Query rows of each batch row (prefill); None for a decode step (one token per row).
    real : bool [batch, q_len]
        Which of the forward's columns are tokens (not padding).
    """

    block_table: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    query_rows: np.ndarray | None
    qo_indptr: np.ndarray | None
    page_size: int
    real: np.ndarray
    _plans: dict = field(default_factory=dict)

    def decode_plan(self, sliding_window):
        """The split-K decode plan for this forward's lengths (made once per window, not per layer)."""
        if sliding_window not in self._plans:
            self._plans[sliding_window] = plan_decode(
                self.seq_lens, page_size=self.page_size, sliding_window=sliding_window)
        return self._plans[sliding_window]


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    sliding_window=None, softcap=None, **kwargs):
    """transformers attention function over pagekv pages (registered as ``"pagekv"``).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (only its ``training`` flag is read).
    query : float [batch, num_q_heads, q_len, head_dim]
    key, value : float [num_pages, num_kv_heads, page_size, head_dim]
        The layer's page pool, as :meth:`PagedCache.update` returns it.
    attention_mask : ignored
        Padding comes from the 2-D mask the forward hook saw; causality from the page tables.
    scaling, sliding_window, softcap : optional
        transformers' names for the kernels' ``scale``, ``sliding_window``, ``logits_soft_cap``.
    **kwargs
        Must carry the forward's page tables (``pagekv_step``), put there by the pool's hook.

    Returns
    -------
    out : [batch, q_len, num_q_heads, head_dim], query's dtype (zeros on padding positions)
    weights : None
    """
    step = kwargs.get(_STEP)
    if not isinstance(step, _Step):
        raise PagekvError("expected a PagedCache from a PagedKVPool as the forward's cache (the 'pagekv' "
                          "attention reads its pages), got a forward without one")
    if module.training and dropout:
        raise PagekvError(f"expected inference (pagekv attention has no dropout), got dropout={dropout} "
                          "in training mode")
    batch, num_heads, q_len, head_dim = query.shape
    rows = _storage(query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim))
    key, value = _storage(key), _storage(value)
    options = dict(scale=scaling, sliding_window=sliding_window, logits_soft_cap=softcap)
    out = torch.empty((batch, q_len, num_heads, head_dim), dtype=query.dtype)
    out_rows = _storage(out.view(batch * q_len, num_heads, head_dim))
    if step.qo_indptr is None:  # decode: one real token per row
        paged_decode_attention(rows, key, value, step.block_table, step.seq_lens, out=out_rows,
                               plan=step.decode_plan(sliding_window), **options)
    elif step.query_rows is None:
        paged_prefill_attention(rows, key, value, step.block_table, step.seq_lens, step.qo_indptr,
                                out=out_rows, **options)
    else:
        out_rows[...] = 0
        out_rows[step.query_rows] = paged_prefill_attention(
            rows[step.query_rows], key, value, step.block_table, step.seq_lens, step.qo_indptr, **options)
    return out, None


def _storage(tensor):
    """A numpy view of a CPU tensor that pagekv reads as the same dtype (bfloat16 as uint16 bits,
    float8_e4m3fn as uint8 bits); a copy only when the tensor is strided.

    The kernels' wrappers take torch tensors too, but converting once here instead of inside every
    check saves tens of microseconds per layer and step.
    """
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    if tensor.dtype == torch.float8_e4m3fn:  # the pages of a float8 pool
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


def register() -> None:
    """Register :func:`paged_attention` as ``"pagekv"`` in transformers' AttentionInterface."""
    AttentionInterface.register(ATTENTION, paged_attention)


class PagedKVPool:
    """The KV pages of one model, and the switch that makes the model compute attention on them.

    Creating a pool allocates every layer's pages as one torch tensor (``storage``, zero-copy under
    pagekv's kernels), switches the model's attention implementation to ``"pagekv"`` and adds a
    forward pre-hook (and a forward hook) to its base model; :meth:`close` undoes both.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only model whose attention layers call transformers' AttentionInterface and its
        ``Cache.update`` (the Llama, Mistral and Qwen2 families among others), of float32, float16
        or bfloat16.
    num_pages : int
        Pages in the pool; one page holds ``page_size`` tokens of every layer.
    page_size : int
        Tokens per page.
    max_seqs : int
        Batch rows alive at once, over every open :class:`PagedCache`.
    enable_prefix_caching : bool
        Full pages of token ids seen before are shared instead of stored again (also across
        ``generate`` calls: a second call with the same system prompt reuses its pages).
    kv_dtype : {"float32", "float16", "bfloat16", "float8_e4m3fn"}, optional
        The pages' dtype; default the model's. ``"float8_e4m3fn"`` holds twice the tokens of
        bfloat16 pages in the same memory: each key and value is rounded to float8 E4M3 as it is
        written (nearest even, saturating at +-448), and attention reads them back exactly.

    Attributes
    ----------
    spec : KVCacheSpec
    storage : torch.Tensor [num_layers, 2, num_pages, num_kv_heads, page_size, head_dim]
    kv : KVCache
        The same memory as numpy views (what the kernels are given).
    manager : KVCacheManager
        Page tables of every live row; ``stats()`` reports it.
    cache_keyword : {"cache", "past_key_values"}
        The name under which this transformers version's ``forward`` and ``generate`` take a
        cache (``cache`` from 5.24 on).
    """

    def __init__(self, model, *, num_pages, page_size=16, max_seqs=64, enable_prefix_caching=True,
                 kv_dtype=None):
        config = model.config.get_text_config(decoder=True)
        if model.dtype not in _DTYPES:
            raise TypeError(f"expected a float32, float16 or bfloat16 model, got {model.dtype}")
        kv_dtype = _DTYPES[model.dtype] if kv_dtype is None else kv_dtype
        if kv_dtype not in _PAGE_DTYPES:
            raise ValueError(f"expected kv_dtype None or one of {', '.join(_PAGE_DTYPES)}, got {kv_dtype!r}")
        if model.device.type != "cpu":
            raise ValueError(f"expected a model on the CPU, got device {model.device}")
        num_q_heads = config.num_attention_heads
        self.spec = KVCacheSpec(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_q_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_q_heads,
            page_size=page_size, dtype=kv_dtype)
        shape = pool_shape(self.spec, num_pages)  # checks num_pages
        num_pages = shape[2]
        check_fits_in_memory("a page pool", num_pages, self.spec.bytes_per_page)
        max_tokens = getattr(config, "max_position_embeddings", None) or num_pages * page_size
        self.manager = KVCacheManager(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                                      max_pages_per_seq=min(num_pages, -(-max_tokens // page_size)),
                                      enable_prefix_caching=enable_prefix_caching)
        # in huge pages (pagekv/_arrays.py says why: torch.zeros here read 1.17-1.19x slower)
        self.storage = torch_zeros_on_line(shape, _PAGE_DTYPES[kv_dtype])
        self.kv = KVCache(self.spec, num_pages, storage=self.storage)  # numpy views, no copy
        self._k = [self.storage[layer, 0] for layer in range(self.spec.num_layers)]
        self._v = [self.storage[layer, 1] for layer in range(self.spec.num_layers)]
        self._ids = itertools.count()
        self._running: PagedCache | None = None  # the cache of the forward under way
        self._model = model
        # transformers 5.24 renamed the cache argument of forward and generate to `cache`
        # (`past_key_values` still works there, with a FutureWarning)
        self.cache_keyword = ("cache" if "cache" in inspect.signature(model.base_model.forward).parameters
                              else "past_key_values")
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION)  # registered when this module was imported
        base = model.base_model
        self._hooks = [base.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                       base.register_forward_hook(self._after_forward, always_call=True)]

    def new_cache(self, *, cache_salt=None) -> "PagedCache":
        """An empty cache for one batch of prompts; pass it to ``generate`` under ``cache_keyword``.
        ``cache_salt``: see :class:`PagedCache`."""
        return PagedCache(self, cache_salt=cache_salt)

    def generate(self, input_ids, *, attention_mask=None, cache_salt=None, **kwargs):
        """``model.generate`` with a fresh :class:`PagedCache`, released when it returns.

        Parameters
        ----------
        input_ids : int64 [batch, prompt_len]
            Left-padded prompts (padding is where ``attention_mask`` is 0).
        attention_mask : int [batch, prompt_len], optional
        cache_salt : bytes or str, optional
            What the KV depends on besides the token ids (see :class:`PagedCache`).
        **kwargs
            Passed to ``generate`` (``max_new_tokens``, ``do_sample``, ...).
        """
        with self.new_cache(cache_salt=cache_salt) as cache:
            return self._model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                        **{self.cache_keyword: cache}, **kwargs)

    def stats(self) -> ManagerStats:
        """Occupancy and prefix-cache figures of the pool (see :class:`pagekv.ManagerStats`)."""
        return self.manager.stats()

    def close(self) -> None:
        """Remove the hooks and give the model back its previous attention implementation."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._model.set_attn_implementation(self._previous_attention)

    # ----------------------------------------------------------------- the forward hooks
    def _before_forward(self, module, args, kwargs):
        cache = kwargs.get(self.cache_keyword)
        if not isinstance(cache, PagedCache) or cache.pool is not self:
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise PagekvError("expected input_ids (token ids key the prefix cache), got inputs_embeds only")
        kwargs[_STEP] = cache._begin(input_ids, kwargs.get("attention_mask"))
        self._running = cache
        return args, kwargs

    def _after_forward(self, module, args, output):
        """Also called when the forward raised (an Exception: output None), to take it back."""
        if self._running is not None:
            if output is None:
                self._running._undo_forward()
            else:
                self._running._finish()
            self._running = None


class PagedCache(Cache):
    """A transformers ``Cache`` whose keys and values live in a :class:`PagedKVPool`'s pages.

    Pass it to ``generate`` or ``forward`` as ``cache=`` (transformers >= 5.24) or
    ``past_key_values=`` (5.23): ``pool.cache_keyword`` says which.

    One cache serves one batch (one ``generate`` call): its first forward adds one pagekv sequence
    per batch row (padding excluded; prompt pages found in the prefix cache are shared, not
    written), later forwards append to them. :meth:`release` (or leaving a ``with`` block, or
    garbage collection) frees the sequences; their full pages stay in the prefix cache. A forward
    that raises is taken back as it raises (one interrupted by KeyboardInterrupt, which torch's
    hooks do not see, at the next forward or release): the cache is as it was before it, and the
    forward can be run again.

    ``get_seq_length`` counts columns (padding included), as transformers expects. Reordering
    (beam search), selecting and repeating rows (``batch_select_indices``,
    ``batch_repeat_interleave``: parallel samples of one prefilled prompt) fork rows (shared pages,
    copy-on-write); cropping (assisted decoding's rollback of rejected drafts) truncates each row's
    sequence.

    ``cache_salt`` (bytes or str) names what the KV depends on besides the token ids: the active
    LoRA adapter when the model switches adapters, the images of a multimodal prompt. Rows share
    prefix-cache pages only with sequences added under the same salt (``KVCacheManager.add_sequence``).
    """

    def __init__(self, pool: PagedKVPool, *, cache_salt=None):
        super().__init__(layers=[])
        self.pool = pool
        self.cache_salt = check_cache_salt(cache_salt)
        self._seq_ids: list = []  # per batch row: its pagekv sequence, None until its first real token
        self._columns = 0
        self._real: list = []  # per finished forward, bool [batch, q_len]: which columns are tokens
        self._step: _Step | None = None
        # How to take the forward under way back if it does not finish: (row, written) for each
        # row it grew - the tokens whose KV was in place before it, 0 for a row it added (freed;
        # the pages it found in the prefix cache stay there). Emptied when the forward finishes.
        self._undo: list = []
        weakref.finalize(self, _release_rows, pool.manager, self._seq_ids, self._undo)

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Free this cache's sequences (their full pages stay in the prefix cache, except those of a
        forward that was interrupted, whose KV may not be there); the cache is empty."""
        _release_rows(self.pool.manager, self._seq_ids, self._undo)
        self._columns, self._step = 0, None
        self._real.clear()

    # ----------------------------------------------------------------- transformers' Cache API
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write one layer's new keys and values into their pages; return the layer's page pool.

        Parameters
        ----------
        key_states, value_states : float [batch, num_kv_heads, q_len, head_dim]

        Returns
        -------
        k_pages, v_pages : torch.Tensor [num_pages, num_kv_heads, page_size, head_dim]
            Views of the pool (no copy), which the ``"pagekv"`` attention reads.
        """
        if self._step is None:
            raise PagekvError("expected a forward started by the PagedKVPool's hook, got update() "
                              "outside one (was the model given to this cache's pool?)")
        batch, heads, q_len, head_dim = key_states.shape
        write_kv(_storage(key_states.transpose(1, 2).reshape(batch * q_len, heads, head_dim)),
                 _storage(value_states.transpose(1, 2).reshape(batch * q_len, heads, head_dim)),
                 self.pool.kv.k(layer_idx), self.pool.kv.v(layer_idx), self._step.slot_mapping)
        return self.pool._k[layer_idx], self.pool._v[layer_idx]

    def get_seq_length(self, layer_idx=0) -> int:
        return self._columns

    def get_mask_sizes(self, query_length, layer_idx):
        return self._columns + query_length, 0

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def reset(self) -> None:
        self.release()

    def reorder_cache(self, beam_idx):
        """Beam search: row ``i`` continues from row ``beam_idx[i]`` (see :meth:`batch_select_indices`).

        Parameters
        ----------
        beam_idx : int [batch]
        """
        sources = self._row_indices(beam_idx, "beam_idx")
        if len(sources) != len(self._seq_ids):
            raise ValueError(f"expected beam_idx of {len(self._seq_ids)} row indices, got {len(sources)}")
        self._rearrange(sources)

    def batch_select_indices(self, indices):
        """Keep the rows ``indices``, in that order; a row named twice or more is forked (pages
        shared, copied on write when a shared partial page is appended to), a row not named is
        freed. No KV is copied here. All-or-nothing.

        Parameters
        ----------
        indices : int [new_batch]
            Row indices in [0, batch), at least one.

        Raises
        ------
        ValueError
            An index out of range or no index; too few free sequence rows (``max_seqs``) for the
            forks.
        """
        self._rearrange(self._row_indices(indices, "indices"))

    def batch_repeat_interleave(self, repeats):
        """Each row becomes ``repeats`` consecutive rows (parallel samples of a prefilled prompt):
        the copies fork it, sharing its pages. ``batch_select_indices`` of each row index repeated."""
        if isinstance(repeats, (bool, np.bool_)) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
            raise ValueError(f"expected repeats a positive integer, got {repeats!r:.80}")
        self._rearrange(np.repeat(np.arange(len(self._seq_ids)), int(repeats)).tolist())

    def _row_indices(self, indices, name) -> list:
        """``indices`` (tensor, array or list of ints) as a list of row indices in [0, batch)."""
        values = np.asarray(indices.cpu() if isinstance(indices, torch.Tensor) else indices)
        batch = len(self._seq_ids)
        if (values.ndim != 1 or (values.size and values.dtype.kind not in "iu")
                or not batch and values.size or ((values < 0) | (values >= batch)).any()):
            raise ValueError(f"expected {name} a 1-D list of row indices in [0, {batch}), got {indices!r:.80}")
        return values.tolist()

    def _rearrange(self, sources) -> None:
        """Row ``i`` continues from row ``sources[i]`` (valid indices): a row's first use keeps its
        sequence, each further use forks it, rows not used are freed. All-or-nothing."""
        if not self._seq_ids:
            return  # nothing held yet: the first forward sets the batch
        if not sources:
            raise ValueError("expected at least one row index, got none")
        manager = self.pool.manager
        uses = Counter(sources)
        unused = [seq_id for row, seq_id in enumerate(self._seq_ids) if row not in uses]
        forks = sum(count - 1 for row, count in uses.items() if self._seq_ids[row] is not None)
        rows = manager.free_rows + sum(seq_id is not None for seq_id in unused)
        if forks > rows:
            raise ValueError(f"expected {forks} free sequence rows for the forked batch rows (max_seqs), "
                             f"got {rows}")
        _free_sequences(manager, unused)
        seq_ids, kept = [], set()
        for row in sources:
            seq_id = self._seq_ids[row]
            if seq_id is not None and row in kept:
                seq_id = next(self.pool._ids)
                manager.fork(self._seq_ids[row], seq_id)
            kept.add(row)
            seq_ids.append(seq_id)
        self._seq_ids[:] = seq_ids
        if self._real:  # one array for all forwards so far (beam search rearranges every step)
            self._real[:] = [np.concatenate(self._real, axis=1)[sources]]

    def crop(self, tokens_to_remove):
        """Drop the last ``-tokens_to_remove`` columns (transformers' convention: a negative count;
        0 drops nothing): assisted decoding's rejected drafts. Each row's sequence keeps its tokens
        before them (``KVCacheManager.truncate`` releases the pages past them); a row left with no
        token is freed and starts again at its next real token.

        Raises
        ------
        ValueError
            ``tokens_to_remove`` not an integer in [-columns, 0]; nothing changed.
        """
        if (isinstance(tokens_to_remove, (bool, np.bool_)) or not isinstance(tokens_to_remove, (int, np.integer))
                or not -self._columns <= tokens_to_remove <= 0):
            raise ValueError(f"expected tokens_to_remove a negative count of the {self._columns} columns "
                             f"held (or 0), got {tokens_to_remove!r:.80}")
        if tokens_to_remove == 0:
            return
        keep = self._columns + int(tokens_to_remove)
        real = np.concatenate(self._real, axis=1)  # bool [batch, columns]
        manager = self.pool.manager
        for i, seq_id in enumerate(self._seq_ids):
            kept = int(real[i, :keep].sum())
            if seq_id is None or kept == manager.seq_len(seq_id):
                continue
            if kept:
                manager.truncate(seq_id, kept)
            else:
                manager.free(seq_id)
                self._seq_ids[i] = None
        self._columns = keep
        self._real[:] = [real[:, :keep]]

    # ----------------------------------------------------------------- one forward
    def _begin(self, input_ids, attention_mask) -> _Step:
        """Grow the page tables by this forward's real tokens and describe them for the layers."""
        if self._step is not None:  # the last forward was interrupted (KeyboardInterrupt)
            self._undo_forward()
        ids = input_ids.detach().cpu().numpy()
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"expected input_ids of shape [batch, q_len >= 1], got {tuple(ids.shape)}")
        batch, q_len = ids.shape
        if self._seq_ids and len(self._seq_ids) != batch:
            raise ValueError(f"expected the batch of {len(self._seq_ids)} rows this cache holds, got {batch}")
        real = self._real_tokens(attention_mask, batch, q_len)
        if not self._seq_ids:
            self._seq_ids.extend([None] * batch)
        manager = self.pool.manager
        if q_len == 1 and real.all() and None not in self._seq_ids:  # decode: all rows or none
            undo = [(row, manager.seq_len(seq_id)) for row, seq_id in enumerate(self._seq_ids)]
            slots = manager.append_tokens(self._seq_ids, ids[:, 0])
            self._undo[:] = undo
        else:
            slots = self._grow_rows(ids, real)
        src, dst = manager.take_pending_copies()
        if len(src):  # copy-on-write of shared partial pages, before any layer writes to them
            for k_pages, v_pages in zip(self.pool._k, self.pool._v):
                copy_pages(k_pages, v_pages, src, dst)
        slot_mapping = np.full(batch * q_len, -1, np.int32)
        slot_mapping[real.ravel()] = slots
        all_real = bool(real.all())
        block_table, seq_lens = self._tables()
        self._step = _Step(
            block_table=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping,
            query_rows=None if all_real else np.flatnonzero(real.ravel()),
            qo_indptr=None if q_len == 1 and all_real else np.concatenate(
                [[0], np.cumsum(real.sum(axis=1))]).astype(np.int32),
            page_size=manager.page_size, real=real)
        return self._step

    def _real_tokens(self, attention_mask, batch, q_len) -> np.ndarray:
        """bool [batch, q_len]: which of the new columns are tokens (not padding)."""
        if attention_mask is None:
            return np.ones((batch, q_len), bool)
        mask = attention_mask.detach().cpu().numpy()
        if mask.shape != (batch, self._columns + q_len):
            raise ValueError(f"expected a 2-D attention_mask of shape {(batch, self._columns + q_len)} "
                             f"(columns seen + new), got {mask.shape}")
        return mask[:, -q_len:] != 0

    def _grow_rows(self, ids, real) -> np.ndarray:
        """Add or extend each row's sequence by its real tokens; int32 slots of those tokens in row
        order, -1 for tokens whose page the prefix cache supplied.

        All or nothing: when a row fails (e.g. OutOfPagesError), the rows grown before it are taken
        back (added ones freed, extended ones cut back), and none of their unwritten pages stays
        in the prefix cache.
        """
        manager = self.pool.manager
        slots = []
        self._undo.clear()
        try:
            for i in np.flatnonzero(real.any(axis=1)).tolist():
                tokens = ids[i][real[i]]
                if self._seq_ids[i] is None:
                    seq_id = next(self.pool._ids)
                    hit = manager.add_sequence(seq_id, tokens, cache_salt=self.cache_salt)
                    self._seq_ids[i] = seq_id
                    self._undo.append((i, 0))
                    row_slots = manager.batch([seq_id], num_new_tokens=len(tokens)).slot_mapping
                    row_slots[:hit] = -1  # pages shared from the prefix cache already hold this K/V
                else:
                    self._undo.append((i, manager.seq_len(self._seq_ids[i])))
                    row_slots = manager.append(self._seq_ids[i], tokens)
                slots.append(row_slots)
        except BaseException:
            self._undo_forward()
            raise
        return np.concatenate(slots) if slots else np.empty(0, np.int32)

    def _tables(self):
        """block_table int32 [batch, used_pages] and seq_lens int32 [batch] (0 for a row not started)."""
        manager = self.pool.manager
        started = [i for i, seq_id in enumerate(self._seq_ids) if seq_id is not None]
        tables = manager.batch([self._seq_ids[i] for i in started])
        used_pages = -(-int(tables.seq_lens.max(initial=0)) // manager.page_size)
        block_table = np.zeros((len(self._seq_ids), used_pages), np.int32)
        seq_lens = np.zeros(len(self._seq_ids), np.int32)
        block_table[started] = tables.block_table[:, :used_pages]
        seq_lens[started] = tables.seq_lens
        return block_table, seq_lens

    def _undo_forward(self) -> None:
        """Take back the forward under way (it raised or was interrupted, its KV not wholly
        written): the cache is as it was before that forward."""
        _take_back(self.pool.manager, self._seq_ids, self._undo)
        self._step = None
        if not self._columns:  # it was the first: the batch size is not settled yet
            self._seq_ids.clear()

    def _finish(self) -> None:
        """The forward returned: its columns are part of the cache now."""
        if self._step is not None:
            self._columns += self._step.real.shape[1]
            self._real.append(self._step.real)
            self._step = None
            self._undo.clear()


def _release_rows(manager, seq_ids: list, undo: list) -> None:
    """Free the rows' sequences after taking back the tokens of a forward that did not finish
    (``undo``); empty both lists."""
    _take_back(manager, seq_ids, undo)
    _free_sequences(manager, seq_ids)


def _free_sequences(manager, seq_ids: list) -> None:
    """Free every sequence of ``seq_ids`` (None: a row not started) the manager holds; empty the list."""
    for seq_id in seq_ids:
        if seq_id is not None and seq_id in manager:
            manager.free(seq_id)
    seq_ids.clear()


def _take_back(manager, seq_ids: list, undo: list) -> None:
    """Undo one forward's growth of the rows (``undo``: (row, written), as PagedCache._undo
    says): its tokens' KV is not (wholly) written, so each row keeps only its ``written`` tokens,
    rows it added are freed, and the prefix cache keeps none of the pages it handed out; empty
    ``undo``."""
    for row, written in undo:
        seq_id = seq_ids[row]
        if seq_id is None or seq_id not in manager:
            continue
        manager.discard(seq_id, written)
        if not written:
            seq_ids[row] = None
    undo.clear()


register()
