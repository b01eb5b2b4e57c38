"""``python -m benchmarks.load``: how many SuperNodes one SuperLink holds on this machine,
measured by :func:`benchmarks.deployment.load_main` (docs/deployment.md, "Load: SuperNodes per
SuperLink")."""

from benchmarks.deployment import load_main

if __name__ == "__main__":
    load_main()
