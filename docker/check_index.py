"""Tell, before pip tries, whether an image build without a wheelhouse can reach its package index.

docker/Dockerfile installs from the wheelhouse (docker/make-wheelhouse.sh) when it holds wheels;
otherwise from the package index. A build container sees none of the host's pip configuration
(its mirror, proxy or extra certificates) and, on an offline machine, no network at all: pip then
retries for a minute and reports ``ResolutionImpossible``, a version conflict, which sends a
newcomer looking in the wrong place. This check asks each index for one project page first and,
when one does not answer, says so plainly and names the fix.

    python3 docker/check_index.py --wheelhouse wheelhouse/cpu URL [URL ...]

Exit status 0 when every URL answered, 1 (with the message on stderr) otherwise.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

#: A project page every index that serves this image's requirements has.
PROBE_PROJECT = "pip"


def unreachable(url: str, timeout: float) -> str | None:
    """Why the index at ``url`` did not serve its page for ``pip``, or ``None`` when it did."""
    page = f"{url.rstrip('/')}/{PROBE_PROJECT}/"
    try:
        with urllib.request.urlopen(page, timeout=timeout) as response:
            response.read(1)
    except urllib.error.HTTPError as error:
        # The index answered (PyTorch's indexes hold no page for pip: 403 or 404), unless a proxy
        # asks for credentials or the server failed.
        if error.code == 407 or error.code >= 500:
            return f"{page}: HTTP {error.code} {error.reason}"
        return None
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return f"{page}: {reason}"
    return None


def message(wheelhouse: str, problems: Sequence[str]) -> str:
    """The build's plain explanation and its fix."""
    lines = [
        f"image build: {wheelhouse} holds no wheels, and this build cannot reach its package "
        "index:",
        *(f"    {problem}" for problem in problems),
        "A build container sees none of the host's pip settings (mirror, proxy, extra CA",
        "certificates) and, offline, no network. Fill the wheelhouse on the host, where pip works,",
        "then build again (it installs from there only, with no network):",
        "    docker/make-wheelhouse.sh",
        "(docs/deployment.md, 'Start the federation and run' and 'Offline builds')",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+", help="package index URLs (PEP 503 simple API)")
    parser.add_argument("--wheelhouse", default="wheelhouse/cpu", help="named in the message")
    parser.add_argument("--timeout", type=float, default=15.0, help="seconds per index")
    args = parser.parse_args(argv)
    problems = [p for url in args.urls if (p := unreachable(url, args.timeout)) is not None]
    if problems:
        print(message(args.wheelhouse, problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
