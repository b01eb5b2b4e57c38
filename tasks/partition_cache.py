"""A disk cache of client partitions, shared by every process that builds the same federation.

In a deployment each message runs the ClientApp in a fresh process, so the in-process cache of
:mod:`tasks.federation` is empty every time and partitioning would be paid per message (when it
went through Flower Datasets, about 4 s of imports first; the NumPy partitioners of
:mod:`tasks.partition` take milliseconds on 60,000 labels). The partitions are a deterministic
function of the labels and the partitioning settings, so they are stored once as ``.npz`` under a
key that hashes both; a changed data file or setting is a new key, never a stale hit.

The folder is ``$BA_PARTITION_CACHE`` when set (``off`` turns the cache off), else
``$XDG_CACHE_HOME/beyond-averaging/partitions`` (``~/.cache/...``). A cache that cannot be
written only costs the speed-up (one warning); an unreadable or inconsistent file is ignored
with a warning and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

#: Environment variable naming the cache folder; ``off`` disables the cache.
CACHE_ENV = "BA_PARTITION_CACHE"
#: Part of every key: bump it when the partitioning code changes its output for equal inputs.
FORMAT_VERSION = 1


def cache_dir() -> Path | None:
    """The cache folder, or None when ``$BA_PARTITION_CACHE`` is ``off``."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() == "off" else Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "beyond-averaging" / "partitions"


def partition_key(settings: Mapping[str, object], labels: np.ndarray) -> str:
    """A hex digest of the partitioning settings and the labels they split."""
    digest = hashlib.sha256()
    described = {"format": FORMAT_VERSION, "labels-dtype": labels.dtype.str, **settings}
    digest.update(json.dumps(described, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(labels).tobytes())
    return digest.hexdigest()


def load_partitions(key: str, num_partitions: int, num_samples: int) -> list[np.ndarray] | None:
    """The cached partitions of ``key``, or None (not cached, cache off, or a bad file).

    A file that does not hold ``num_partitions`` integer arrays of positions in
    ``[0, num_samples)`` is ignored with a warning (and overwritten by the next store).
    """
    folder = cache_dir()
    path = None if folder is None else folder / f"{key}.npz"
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            partitions = [stored[f"arr_{index}"] for index in range(num_partitions)]
    except (OSError, ValueError, KeyError) as error:
        warnings.warn(
            f"partition cache file {path} is unreadable ({error}); partitioning again",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for indices in partitions:
        valid = indices.ndim == 1 and np.issubdtype(indices.dtype, np.integer)
        if not valid or (indices.size and not 0 <= indices.min() <= indices.max() < num_samples):
            warnings.warn(
                f"partition cache file {path} does not fit this data set "
                f"({num_samples} samples); partitioning again",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
    return partitions


def store_partitions(key: str, partitions: Sequence[np.ndarray]) -> None:
    """Write the partitions of ``key`` atomically (a concurrent reader never sees half a file)."""
    folder = cache_dir()
    if folder is None:
        return
    temporary: Path | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".npz.tmp", delete=False) as handle:
            temporary = Path(handle.name)
            np.savez(handle, *partitions)  # arr_0, arr_1, ... in partition order
        os.replace(temporary, folder / f"{key}.npz")
    except OSError as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        warnings.warn(
            f"cannot write the partition cache in {folder} ({error}): every new process "
            f"partitions again; set {CACHE_ENV} to a writable folder, or to 'off'",
            RuntimeWarning,
            stacklevel=2,
        )
