"""Numba's kernel cache is emptied when any kernel source changes (Numba itself would not notice)."""

from pagekv.kernels._stale_cache import STAMP, drop_stale_cache, sources_digest


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
