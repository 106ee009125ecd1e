"""Numba's kernel cache: emptied when any kernel source changes (Numba itself would not notice),
and found again by every new process."""

import os
import subprocess
import sys

from pagekv.kernels._stale_cache import STAMP, drop_stale_cache, sources_digest

# What Numba keys a cached closure on besides its bytecode: the pickled contents of its cells.
_CLOSURE_KEYS = """
import hashlib
from numba.core.serialize import dumps
from pagekv.kernels import attention
for kernels in (attention._DECODE, attention._PREFILL):
    for kv_format, kernel in sorted(kernels.items()):
        cells = tuple(cell.cell_contents for cell in kernel.py_func.__closure__ or ())
        print(kv_format, hashlib.sha256(dumps(cells)).hexdigest())
"""


def test_cache_is_dropped_when_a_source_changes_and_kept_otherwise(tmp_path):
    sources, cache = tmp_path / "kernels", tmp_path / "kernels" / "__pycache__"
    cache.mkdir(parents=True)
    (sources / "attention.py").write_text("x = 1\n")
    (sources / "_dtypes.py").write_text("y = 1\n")
    (cache / "attention.decode-1.py311.nbi").write_text("index")
    (cache / "attention.decode-1.py311.1.nbc").write_text("code")
    (cache / "other.pyc").write_text("not numba's")
    assert drop_stale_cache(sources, cache)               # no stamp yet: cannot trust the cache
    assert sorted(p.name for p in cache.iterdir()) == sorted([STAMP, "other.pyc"])
    (cache / "attention.decode-1.py311.nbi").write_text("index")
    assert not drop_stale_cache(sources, cache)           # same sources: cache kept
    assert (cache / "attention.decode-1.py311.nbi").exists()
    (sources / "_dtypes.py").write_text("y = 2\n")        # a helper changed
    assert drop_stale_cache(sources, cache)
    assert not (cache / "attention.decode-1.py311.nbi").exists()
    assert (cache / STAMP).read_text() == sources_digest(sources)


def test_a_cache_folder_made_now_is_stamped_so_what_compiles_into_it_is_kept(tmp_path):
    sources, cache = tmp_path / "kernels", tmp_path / "cache" / "kernels_0123"
    sources.mkdir()
    (sources / "attention.py").write_text("x = 1\n")
    assert not drop_stale_cache(sources, cache)
    (cache / "attention.decode-1.py311.nbi").write_text("compiled after the stamp")
    assert not drop_stale_cache(sources, cache)  # the next process keeps it
    assert (cache / "attention.decode-1.py311.nbi").exists()


def test_every_process_computes_the_same_cache_keys_for_the_kernels(tmp_path):
    """A kernel whose closure held a dispatcher (pickled with a random id per process) was never
    found in the on-disk cache: warmup() recompiled decode and prefill in every process. (Run in
    an empty folder: from the checkout, ``-c`` would import the source folder, not the install.)"""
    keys = [subprocess.run([sys.executable, "-c", _CLOSURE_KEYS], capture_output=True, text=True,
                           check=True, cwd=tmp_path).stdout for _ in range(2)]
    assert keys[0] == keys[1] and keys[0].count("\n") == 12  # 6 kinds of kernel, decode and prefill


_WHERE_NUMBA_CACHES = """
import pathlib
import pagekv.kernels
from pagekv.kernels import _cache_dir
from pagekv.kernels.bandwidth import stream_sum
folder = pathlib.Path(pagekv.kernels.__file__).parent
print(_cache_dir.kernels_cache(folder) == pathlib.Path(stream_sum._cache._cache_path))
"""


def test_a_numba_cache_dir_is_kept_fresh_too(tmp_path):
    """Under NUMBA_CACHE_DIR (set by a user, or by pagekv where nothing else is writable) the
    kernels' files land in a subfolder named as Numba names it; that subfolder is emptied of
    machine code from other sources like the default one."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, cwd=tmp_path, env=env).stdout

    assert run(_WHERE_NUMBA_CACHES).strip() == "True"
    kernels = next((tmp_path / "cache").glob("kernels_*"))
    (kernels / STAMP).write_text("the digest of other sources")
    (kernels / "attention.decode-1.py311.nbi").write_text("stale index")
    run("import pagekv.kernels")
    assert not (kernels / "attention.decode-1.py311.nbi").exists()
    assert (kernels / STAMP).read_text() != "the digest of other sources"
