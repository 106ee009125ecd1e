"""Where Numba keeps pagekv's compiled kernels when neither of its own places is writable.

Numba caches a ``cache=True`` kernel next to its source (``__pycache__``) or, failing that, in the
user's cache folder (``~/.cache/numba``); when neither is writable — a read-only install run by a
user without a writable home, as in containers run under an arbitrary uid — it refuses to define
the kernel at all, and ``import pagekv.attention`` failed with "cannot cache function ...: no
locator available" (measured: a wheel installed by root, run as ``nobody``). pagekv then points
Numba at a folder of the temporary directory, and says so once.

:func:`kernels_cache` names the folder the kernels' files land in, wherever that is, so that
kernels/_stale_cache.py can keep it fresh.
"""

import hashlib
import logging
import os
import pathlib
import tempfile

LOGGER = logging.getLogger("pagekv")


def writable(folder: pathlib.Path) -> bool:
    """Whether ``folder`` can be created and written to (as Numba checks its cache folders)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return False
    return True


def fallback_folder() -> pathlib.Path:
    """A folder of this user's own in the temporary directory."""
    return pathlib.Path(tempfile.gettempdir()) / f"pagekv-numba-cache-{os.getuid()}"


def choose(in_tree: pathlib.Path, user_wide: pathlib.Path, fallback: pathlib.Path):
    """The folder Numba must be told to use, or None when one of its own places works (or when
    nothing is writable at all: then Numba's own error explains it)."""
    if writable(in_tree) or writable(user_wide) or not writable(fallback):
        return None
    return fallback


def ensure(kernels_folder: pathlib.Path) -> None:
    """Give Numba a writable cache folder for the kernels in ``kernels_folder`` if it has none.

    Sets ``NUMBA_CACHE_DIR`` too, so the interpreters of :func:`pagekv.kernels.warmup` use the
    same folder, and so a later re-read of the environment by Numba keeps it.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    import numba
    from numba.misc.appdirs import AppDirs  # the folder Numba's user-wide locator uses

    user_wide = pathlib.Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)
    folder = choose(kernels_folder / "__pycache__", user_wide, fallback_folder())
    if folder is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = str(folder)
    numba.config.CACHE_DIR = str(folder)  # type: ignore[attr-defined]  # set from the environment
    LOGGER.warning("pagekv: neither %s nor %s is writable; compiled kernels are cached in %s "
                   "(set NUMBA_CACHE_DIR to choose)", kernels_folder / "__pycache__", user_wide,
                   folder)


def kernels_cache(kernels_folder: pathlib.Path) -> pathlib.Path:
    """The folder Numba files the kernels of ``kernels_folder`` in: its ``__pycache__``, or under
    NUMBA_CACHE_DIR a subfolder named as Numba names it (the folder's name and the SHA-1 of its
    absolute path; were Numba to change that, the name points nowhere and nothing is dropped)."""
    root = os.environ.get("NUMBA_CACHE_DIR")
    if not root:
        return kernels_folder / "__pycache__"
    absolute = os.path.abspath(kernels_folder)
    return pathlib.Path(root) / f"{os.path.basename(absolute)}_{hashlib.sha1(absolute.encode()).hexdigest()}"
