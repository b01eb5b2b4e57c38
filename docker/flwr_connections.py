"""Add the compose stack's SuperLink connections to a host's Flower CLI configuration.

For a ``flwr`` CLI on the host (or on a workstation through an SSH tunnel) rather than compose's
``flwr`` service: writes the connections ``local-deployment`` (insecure) and
``local-deployment-tls`` (trusting the CA of docker/make-certs.sh, by its absolute path) to
``$FLWR_HOME/config.toml`` (``~/.flwr/config.toml`` by default), so that no path is guessed.

    python3 docker/flwr_connections.py [--port 9093] [--certs docker/certs] [--config PATH]

``--port`` is the host port of the SuperLink's Control API: BA_CONTROL_PORT when set (9093
by default, 9095 with docker/http.env). An existing file keeps its other connections; a
connection of the same name is replaced. Prints what it wrote.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = ("local-deployment", "local-deployment-tls")


def connections(port: int, ca_cert: Path) -> str:
    """The two connection tables, the CA named by its absolute path."""
    return (
        f'[superlink.{NAMES[0]}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n\n'
        f'[superlink.{NAMES[1]}]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{ca_cert.resolve()}"\n'
    )


def without_tables(text: str, names: Sequence[str]) -> str:
    """``text`` without the TOML tables ``[superlink.<name>]`` of ``names`` (header to the next
    table header)."""
    kept: list[str] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        header = re.match(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
        if header is not None:
            dropping = header.group(1).strip() in {f"superlink.{name}" for name in names}
        if not dropping:
            kept.append(line)
    return "".join(kept).rstrip("\n")


def default_config() -> Path:
    home = os.environ.get("FLWR_HOME")
    return Path(home) / "config.toml" if home else Path.home() / ".flwr" / "config.toml"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    port = os.environ.get("BA_CONTROL_PORT") or "9093"
    parser.add_argument("--port", type=int, default=int(port), help=f"default {port}")
    parser.add_argument("--certs", type=Path, default=REPO / "docker" / "certs")
    parser.add_argument("--config", type=Path, default=default_config())
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port (1-65535)")
    ca_cert = args.certs / "ca.crt"
    if not ca_cert.is_file():
        print(
            f"flwr_connections: no CA certificate at {ca_cert} yet: local-deployment-tls names it "
            "anyway; create it with docker/make-certs.sh before using that connection",
            file=sys.stderr,
        )
    existing = args.config.read_text(encoding="utf-8") if args.config.is_file() else ""
    kept = without_tables(existing, NAMES)
    added = connections(args.port, ca_cert)
    args.config.parent.mkdir(parents=True, exist_ok=True)
    args.config.write_text(f"{kept}\n\n{added}" if kept else added, encoding="utf-8")
    print(f"# written to {args.config}:\n{added}", end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
