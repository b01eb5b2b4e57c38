"""Copy scikit-learn's digits table out of its wheel, for an image without scikit-learn.

``tasks/datasets.py`` parses ``sklearn/datasets/data/digits.csv.gz`` itself (bit-identical to
``sklearn.datasets.load_digits``) and finds it at ``$BA_DIGITS_CSV``; the image sets that to the
file this script writes, so the app reads the same bytes without scikit-learn, SciPy, pandas or
pyarrow installed (about 450 MB).

Usage: ``python docker/extract_digits.py <scikit_learn-*.whl> <destination>``
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

MEMBER = "sklearn/datasets/data/digits.csv.gz"


def extract(wheel: Path, destination: Path) -> int:
    """Write the wheel's digits table to ``destination``; its size in bytes."""
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read(MEMBER)
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(data)
    return len(data)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    size = extract(Path(argv[0]), Path(argv[1]))
    print(f"extract_digits: {MEMBER} ({size} B) -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
