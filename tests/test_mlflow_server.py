"""A run tracked to MLflow's own server, read back with MLflow's own tools (issue 43).

The real ``mlflow server`` (the ``[mlflow-ui]`` extra, which scripts/setup.sh installs) is
started on loopback with a SQLite store and served artifacts, as docs/running.md starts it; a
``ba-run`` of the in-process runtime tracks to it; then the run, its parameters, metrics, source
tags, files and model are read over MLflow's REST API with plain HTTP, and the model is loaded
with ``mlflow.pytorch.load_model`` and registered in MLflow's model registry. Without MLflow's
server installed (``[mlflow]`` alone is the light client) the test skips, saying so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from beyond_averaging.server.cli.main import main as ba_run
from beyond_averaging.server.overrides import run_config_argument
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from tests.test_inprocess import REPO
from tests.test_tracking import SETTINGS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("flask") is None,
    reason="MLflow's server is not installed here (the [mlflow] extra is its client alone): "
    "pip install 'beyond-averaging[mlflow-ui]', which scripts/setup.sh installs",
)

#: Seconds MLflow's server may take to answer /health (it creates its SQLite tables first; on a
#: machine busy with other work that took over 90 s here).
START_SECONDS = 180.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """MLflow's REST API at ``url``, over plain HTTP."""

    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, endpoint: str, **query: str) -> Any:
        address = f"{self.url}{endpoint}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(address, timeout=30) as response:
            return json.loads(response.read())

    def post(self, endpoint: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            f"{self.url}{endpoint}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[Server]:
    """``mlflow server`` on a free loopback port, its store and artifacts in ``tmp_path``."""
    port = free_port()
    store = tmp_path / "server"
    store.mkdir()
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{store / 'mlflow.db'}",
        "--artifacts-destination",
        str(store / "artifacts"),
    ]
    # No job runner (GenAI scoring and trace archival): nothing here uses it, and it slows the
    # start.
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = (store / "server.log").open("wb")
    process = subprocess.Popen(
        command, cwd=store, stdout=log, stderr=subprocess.STDOUT, env=environment
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert process.poll() is None, (store / "server.log").read_text(errors="replace")
            assert time.monotonic() < deadline, f"mlflow server not up after {START_SECONDS} s"
            time.sleep(0.3)
        yield Server(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_a_run_read_back_from_mlflows_server_has_its_config_metrics_tags_files_and_model(
    mlflow_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = mlflow_server
    settings = {
        **SETTINGS,
        "output-dir": str(tmp_path / "runs"),
        "tracker": "mlflow",
        "tracker-uri": server.url,
        "tracker-project": "served",
    }
    arguments = ["--app", str(REPO), "--runtime", "inprocess", "-c", run_config_argument(settings)]
    assert ba_run(arguments) == 0
    folder = tmp_path / "runs" / "r"
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    rounds = [
        json.loads(line)
        for line in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]

    # The run: found by its experiment's name, finished, with every option as a parameter.
    experiment = server.get("/api/2.0/mlflow/experiments/get-by-name", experiment_name="served")[
        "experiment"
    ]
    [found] = server.post(
        "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment["experiment_id"]]}
    )["runs"]
    run_id = found["info"]["run_id"]
    run = server.get("/api/2.0/mlflow/runs/get", run_id=run_id)["run"]
    assert run["info"]["run_name"] == "r"
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params == {key: str(value) for key, value in summary["config"].items()}

    # Every round's test accuracy, at its round.
    history = server.get(
        "/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key="test-accuracy"
    )["metrics"]
    assert {int(m.get("step", 0)): m["value"] for m in history} == {
        r["round"]: pytest.approx(r["test-accuracy"]) for r in rounds
    }

    # MLflow's source tags: the command, the checkout's commit, the user.
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["mlflow.runName"] == "r"
    assert tags["mlflow.source.name"] == "ba-run"
    assert tags["mlflow.source.type"] == "LOCAL"
    assert tags["command-line"] == summary["command-line"]
    assert tags["command-line"].startswith("ba-run --app ")
    git = summary["environment"]["git"]
    if git is not None:  # a checkout (this repository's tests run from one)
        assert tags["mlflow.source.git.commit"] == git["commit"]
    assert tags["mlflow.user"]

    # The run's files, log.txt among them.
    files = {
        entry["path"]
        for entry in server.get("/api/2.0/mlflow/artifacts/list", run_id=run_id)["files"]
    }
    assert {"summary.json", "metrics.csv", "clients.jsonl", "final_model.pt", "log.txt"} <= files

    # The final model: a logged model of the run, ready, in MLflow's PyTorch flavour.
    [output] = run["outputs"]["model_outputs"]
    model = server.get(f"/api/2.0/mlflow/logged-models/{output['model_id']}")["model"]
    assert model["info"]["name"] == "model"
    assert model["info"]["source_run_id"] == run_id
    assert model["info"]["status"] == "LOGGED_MODEL_READY"
    assert int(output["step"]) == rounds[-1]["round"]
    location = model["info"]["artifact_uri"].removeprefix("mlflow-artifacts:/")
    model_files = {
        entry["path"]
        for entry in server.get("/api/2.0/mlflow-artifacts/artifacts", path=location)["files"]
    }
    assert {"MLmodel", "data", "requirements.txt", "input_example.json"} <= model_files

    # Loaded with MLflow's own loader, it is the run's final model: the same weights as
    # final_model.pt, the same outputs as the run's model class with them.
    import mlflow.pytorch

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    loaded = mlflow.pytorch.load_model(f"runs:/{run_id}/model")
    final = torch.load(folder / "final_model.pt", weights_only=True)
    weights = loaded.state_dict()
    assert sorted(weights) == sorted(final)
    for key, value in final.items():
        assert torch.equal(weights[key], value), key
    test_set, _ = load_server_splits(_data_spec(summary["config"]))
    reference = build_model(
        summary["config"]["model"], test_set.input_shape, test_set.num_classes, seed=0
    )
    reference.load_state_dict(final)
    inputs = torch.from_numpy(test_set.features[:16].copy())
    with torch.no_grad():
        assert torch.allclose(loaded(inputs), reference.eval()(inputs), atol=1e-6)

    # And MLflow's model registry takes it.
    server.post("/api/2.0/mlflow/registered-models/create", {"name": "digits-fedavg"})
    version = server.post(
        "/api/2.0/mlflow/model-versions/create",
        {
            "name": "digits-fedavg",
            "source": f"models:/{output['model_id']}",
            "run_id": run_id,
            "model_id": output["model_id"],
        },
    )["model_version"]
    assert version["version"] == "1"
    registered = mlflow.pytorch.load_model("models:/digits-fedavg/1")
    assert torch.equal(registered.state_dict()[next(iter(final))], next(iter(final.values())))


def _data_spec(config: dict[str, Any]) -> Any:
    """The run's data specification, as the ServerApp builds it from the run's options."""
    from beyond_averaging.server.app import data_spec
    from beyond_averaging.server.config import parse_run_config

    return data_spec(parse_run_config(config))
