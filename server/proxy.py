"""FedLAW's server proxy set: k held-out samples per class, or the IDX files of ``proxy-dir``.

By default the proxy set is ``proxy-per-class`` samples of every class drawn from the held-out
data and removed from the test set (``tasks.splits.split_server_data``), like the paper's proxy
sets drawn from the test set (appendix D.2). ``proxy-dir`` points to a folder of your own data
in the IDX format of the image data sets instead: exactly one image file (name containing
``idx3-ubyte``, e.g. ``proxy-images-idx3-ubyte.gz``) and one label file (name containing
``idx1-ubyte``), plain or gzip, images as unsigned bytes (IDX type 0x08). Pixels are divided by
255 as the MNIST/Fashion-MNIST loader does, giving features in [0, 1] like every image data set
here (for ``digits``, whose loader divides its 0..16 pixels by 16, write round(255 * pixel / 16)).
Set ``proxy-per-class = 0`` with ``proxy-dir`` to keep the whole held-out split for testing.
Nothing checks that your files are disjoint from the test set: keep them so, or the reported
accuracy is optimistic.
"""

from __future__ import annotations

from pathlib import Path

from beyond_averaging.tasks.datasets import LabeledData, _idx_pair

from .config import ConfigError, RunConfig

_IMAGES_MARK = "idx3-ubyte"
_LABELS_MARK = "idx1-ubyte"


def _single_file(folder: Path, mark: str, what: str) -> Path:
    found = sorted(path for path in folder.iterdir() if path.is_file() and mark in path.name)
    if len(found) != 1:
        names = [path.name for path in found]
        raise ConfigError(
            f"proxy-dir = '{folder}' must hold exactly one IDX {what} file (a name containing "
            f"'{mark}', optionally .gz), found {len(found)}: {names}"
        )
    return found[0]


def load_proxy_dir(
    directory: str | Path, *, num_classes: int, input_shape: tuple[int, ...]
) -> LabeledData:
    """Read the proxy set from an IDX image/label pair in ``directory``.

    Parameters
    ----------
    directory : str or Path
        The ``proxy-dir`` folder.
    num_classes : int
        Classes of the run's data set (the model's outputs); labels must lie below it.
    input_shape : tuple of int
        Shape of one sample of the run's data set; the images must match it.

    Raises
    ------
    ConfigError
        Missing folder or files, an unreadable or inconsistent IDX pair, a sample shape or label
        range that does not fit the run's data set; the message names the path and the value.
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(
            f"proxy-dir = '{directory}' is not a folder: point it to a folder holding one IDX "
            f"image file (*{_IMAGES_MARK}[.gz]) and one IDX label file (*{_LABELS_MARK}[.gz])"
        )
    images = _single_file(folder, _IMAGES_MARK, "image")
    labels = _single_file(folder, _LABELS_MARK, "label")
    try:
        data = _idx_pair(images, labels)
    except ValueError as error:
        raise ConfigError(f"proxy-dir = '{directory}': {error}") from None
    if data.input_shape != input_shape:
        raise ConfigError(
            f"proxy-dir = '{directory}': {images.name} holds samples of shape {data.input_shape} "
            f"but the run's data set has samples of shape {input_shape}: write images of that "
            "size"
        )
    if len(data) and int(data.labels.max()) >= num_classes:
        raise ConfigError(
            f"proxy-dir = '{directory}': {labels.name} has labels up to "
            f"{int(data.labels.max())} but the run's data set has {num_classes} classes "
            f"(labels 0..{num_classes - 1})"
        )
    return LabeledData(data.features, data.labels, num_classes)


def resolve_proxy_set(config: RunConfig, heldout_proxy: LabeledData) -> tuple[LabeledData, str]:
    """The proxy set a run uses and a description of its source for messages.

    Parameters
    ----------
    config : RunConfig
        The run configuration (``proxy-dir``, ``proxy-per-class``).
    heldout_proxy : LabeledData
        The held-out proxy split (``proxy-per-class`` samples per class); its class count and
        sample shape are the run data set's.
    """
    if not config.proxy_dir:
        source = f"held-out split, proxy-per-class = {config.proxy_per_class}"
        return heldout_proxy, source
    loaded = load_proxy_dir(
        config.proxy_dir,
        num_classes=heldout_proxy.num_classes,
        input_shape=heldout_proxy.input_shape,
    )
    return loaded, f"proxy-dir = '{config.proxy_dir}'"
