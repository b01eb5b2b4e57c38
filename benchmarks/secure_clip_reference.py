"""The plain run with secure aggregation's client-side clip: what a secure run is compared with.

``ba-run --runtime inprocess`` of this repository's app with the given ``-c`` overrides, where
each client, before replying, scales its update theta - w to L2 norm <= C in the clear (in
float64, over every tensor together, as ``secure-clip-norm = C`` does before masking) and the
server's per-reply bounds are off (secure aggregation turns them off). A secure run at that clip
differs from it by quantisation alone (docs/results/secure-aggregation.md). Prints the final
test accuracy.

Usage::

    .venv/bin/python -m benchmarks.secure_clip_reference --clip 1.0 -c 'strategy="fedgma"'
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from benchmarks.spec import REPO
from beyond_averaging.client import app as project
from beyond_averaging.server.overrides import parse_overrides
from beyond_averaging.server.runs.folder import read_summary
from beyond_averaging.server.runtime.inprocess import run_inprocess
from beyond_averaging.tasks.secure_aggregation import clip_scale

BOUNDS_OFF = {f"{name}-factor": 0.0 for name in ("update-norm", "update-clip", "direction-outlier")}
CLIP = {"norm": 0.0}
app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    """The project's train function, its reply's update clipped to ``CLIP["norm"]``."""
    received = {
        k: a.numpy().astype(np.float64) for k, a in message.content.array_records["arrays"].items()
    }
    reply = project.train(message, context)
    trained = {k: a.numpy() for k, a in reply.content.array_records["arrays"].items()}
    scale = clip_scale({k: trained[k] - received[k] for k in received}, CLIP["norm"])
    clipped = {
        k: (received[k] + scale * (trained[k] - received[k])).astype(trained[k].dtype)
        for k in received
    }
    content = RecordDict(dict(reply.content.items()))
    content["arrays"] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in clipped.items()})
    return Message(content=content, reply_to=message)


app.evaluate()(project.evaluate_local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clip", type=float, required=True, help="C, as secure-clip-norm")
    parser.add_argument("-c", "--run-config", action="append", default=[])
    args = parser.parse_args()
    if not args.clip > 0:
        parser.error(f"--clip {args.clip}: allowed is a norm > 0")
    from benchmarks import secure_clip_reference as loaded  # the module the app loader imports

    loaded.CLIP["norm"] = args.clip
    with tempfile.TemporaryDirectory() as folder:
        # This app: the repository's pyproject, its ClientApp this module's.
        text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
        app_line = 'clientapp = "benchmarks.secure_clip_reference:app"'
        text = re.sub(r'(?m)^clientapp = ".*"$', app_line, text)
        (Path(folder) / "pyproject.toml").write_text(text, encoding="utf-8")
        overrides = {**parse_overrides(args.run_config), **BOUNDS_OFF, "max-claim-factor": 0.0}
        overrides |= {"output-dir": folder, "run-name": "clip-reference"}
        run_inprocess(Path(folder), overrides)
        summary = read_summary(Path(folder) / "clip-reference")
    print(f"final test accuracy {summary['final']['test-accuracy']:.4f}")


if __name__ == "__main__":
    main()
