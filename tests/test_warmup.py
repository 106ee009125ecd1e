"""warmup(): its arguments, the order of its work, its reading of Numba's cache index, and the
interpreters that compile into that cache side by side."""

import os
import subprocess
import sys

import pytest

from pagekv.kernels import _warm, warmup

_ANNOUNCE_TWICE = """
from pagekv.kernels import _warm
from pagekv.kernels import attention as kernels
for _ in range(2):
    _warm.announce_compile(kernels._DECODE["float32"], "float32", "decode")
"""
_COMPILED_IN_EMPTY_CACHE = """
from pagekv.kernels import _warm
print(_warm.compiled(("float32", "bfloat16"), 128, 16))
"""


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtypes=("int8",)), "expected dtypes among float32, float16, bfloat16, float8_e4m3fn, got 'int8'"),
    (dict(processes=0), "expected processes None or an int >= 1, got 0"),
    (dict(processes=1.5), "expected processes None or an int >= 1, got 1.5"),
    (dict(progress="yes"), "expected progress None, True or False, got 'yes'"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        warmup(**kwargs)


def test_the_long_compiles_go_first_and_each_dtype_once():
    assert _warm.tasks(("bfloat16", "float32", "bfloat16")) == [
        ("decode", "bfloat16"), ("decode", "float32"), ("prefill", "bfloat16"),
        ("prefill", "float32"), ("ops", "bfloat16"), ("ops", "float32")]
    assert _warm.tasks("float16") == [("decode", "float16"), ("prefill", "float16"), ("ops", "float16")]


def test_an_empty_cache_reads_as_not_compiled(tmp_path):
    # A fresh interpreter with its own empty cache: nothing compiled, and asking compiles nothing.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", _COMPILED_IN_EMPTY_CACHE], capture_output=True,
                         text=True, check=True, cwd=tmp_path, env=env).stdout
    assert out.strip() == "False"
    assert not list((tmp_path / "cache").rglob("*.nbi"))


def test_a_warm_cache_reads_as_compiled():
    warmup(dtypes=("float32",), head_dim=64, page_size=2, processes=1)
    assert _warm.compiled(("float32",), 64, 2)


def test_interpreters_compile_into_the_cache(tmp_path, monkeypatch):
    # The light kernels (cache operations) in one interpreter with an empty cache of its own: its
    # machine code lands in that cache, which this process would then load.
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    _warm.compile_in_subprocesses([("ops", "float32")], 1, 64, 2)
    written = {path.name.split("-")[0] for path in tmp_path.rglob("*.nbi")}
    assert {"cache_ops.write_kv", "cache_ops.copy_pages", "cache_ops.gather_kv",
            "cache_ops.merge_states"} <= written


def test_one_kinds_kernel_in_the_index_does_not_count_for_another(monkeypatch):
    # The decode kernels of every storage kind are one closure with other cells, so they share one
    # index file: only an entry with this kernel's own hashes counts.
    from pagekv.kernels import attention as kernels

    float32, bfloat16 = kernels._DECODE["float32"], kernels._DECODE["bfloat16"]
    entry = {float32._cache._index_key(None, float32.targetctx.codegen()): "float32 decode.nbc"}
    for dispatcher in (float32, bfloat16):
        monkeypatch.setattr(dispatcher._cache._cache_file, "_load_index", lambda: entry)
    assert _warm._in_cache(float32)
    assert not _warm._in_cache(bfloat16)


def test_a_kernel_about_to_compile_is_announced_once(tmp_path):
    # A fresh interpreter with an empty cache of its own: the decode kernel would compile.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    err = subprocess.run([sys.executable, "-c", _ANNOUNCE_TWICE], capture_output=True, text=True,
                         check=True, cwd=tmp_path, env=env).stderr
    assert err.count("pagekv: compiling the float32 decode kernel for this CPU, once") == 1, err


def test_a_cached_or_loaded_kernel_is_not_announced(tmp_path):
    warmup(dtypes=("float32",), head_dim=64, page_size=2, processes=1)
    # In the disk cache, not loaded yet (a new interpreter on the same cache): nothing said.
    result = subprocess.run([sys.executable, "-c", _ANNOUNCE_TWICE], capture_output=True, text=True,
                            check=True, cwd=tmp_path)
    assert "compiling" not in result.stderr, result.stderr


def test_the_progress_bar_shows_when_asked_or_when_compiling(capsys, monkeypatch):
    options = dict(dtypes="float32", head_dim=64, page_size=2, processes=1)
    warmup(**options)
    capsys.readouterr()
    warmup(**options)  # everything cached: no bar by default
    assert "pagekv kernels" not in capsys.readouterr().err
    warmup(**options, progress=True)
    assert "pagekv kernels" in capsys.readouterr().err
    monkeypatch.setattr(_warm, "compiled", lambda *args: False)  # as if the cache were cold
    warmup(**options)
    assert "pagekv kernels" in capsys.readouterr().err
    warmup(**options, progress=False)
    assert "pagekv kernels" not in capsys.readouterr().err


def test_a_cache_folder_is_found_where_numba_has_none(tmp_path):
    """A read-only install run without a writable home: Numba has nowhere to cache and refused
    to define the kernels; pagekv then names a folder of the temporary directory. (Unwritable
    here means under a file, which stops root too.)"""
    from pagekv.kernels import _cache_dir

    blocked = tmp_path / "a file"
    blocked.write_text("")
    writable_dir, fallback = tmp_path / "ok", tmp_path / "fallback"
    assert _cache_dir.choose(blocked / "in-tree", blocked / "home", fallback) == fallback
    assert _cache_dir.choose(writable_dir, blocked / "home", fallback) is None
    assert _cache_dir.choose(blocked / "in-tree", writable_dir, fallback) is None
    assert _cache_dir.choose(blocked / "in-tree", blocked / "home", blocked / "tmp") is None


def test_numba_is_pointed_at_the_fallback_before_any_kernel_exists(tmp_path, monkeypatch):
    from pagekv.kernels import _cache_dir

    monkeypatch.setenv("NUMBA_CACHE_DIR", "")  # unset as far as ensure() sees; restored after
    monkeypatch.setattr(_cache_dir, "choose", lambda *folders: tmp_path)
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)
    _cache_dir.ensure(tmp_path)
    assert os.environ["NUMBA_CACHE_DIR"] == numba.config.CACHE_DIR == str(tmp_path)
