"""Drop Numba's on-disk kernel cache when any kernel source changed.

Numba keys a cached kernel on its own file's timestamp only: edit a helper in another file (say
``_dtypes.py``) and kernels in ``attention.py`` that inlined the old helper keep loading stale
machine code. Measured here: a changed overload was silently ignored until the cache was cleared.
This module stamps the cache directory with a hash of every kernel source and empties it of
Numba's files when the hash differs.
"""

import hashlib
import pathlib

STAMP = "pagekv-kernel-sources.sha256"


def sources_digest(folder: pathlib.Path) -> str:
    """SHA-256 over the names and bytes of every .py file in ``folder``."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def drop_stale_cache(folder: pathlib.Path, cache_dir: pathlib.Path) -> bool:
    """Delete Numba's cache files in ``cache_dir`` if ``folder``'s sources changed since the last
    stamp; returns whether it did. Any OS error (read-only install) leaves things as they are."""
    digest = sources_digest(folder)
    stamp = cache_dir / STAMP
    try:
        if stamp.exists() and stamp.read_text() == digest:
            return False
        if not cache_dir.exists():  # an empty cache is fresh: stamp it, or the next process
            cache_dir.mkdir(parents=True)  # would drop what this one compiles into it
            stamp.write_text(digest)
            return False
        for path in list(cache_dir.glob("*.nbi")) + list(cache_dir.glob("*.nbc")):
            path.unlink()
        stamp.write_text(digest)
        return True
    except OSError:
        return False
