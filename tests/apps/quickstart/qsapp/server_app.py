"""qsapp: the ServerApp, as Flower's quickstart-pytorch writes it.

The user-app tests replace the strategy lines (between >>> and <<<) by a rule's server recipe
from docs/, and pass `result-file`: where the run's Result goes as JSON for the test to read.
"""

import json
import math
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from qsapp.task import Net, load_proxy_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = context.run_config["num-server-rounds"]
    lr = context.run_config["learning-rate"]
    net = Net()
    proxy_loader = load_proxy_data()

    # >>> strategy
    from beyond_averaging import FedAvg

    strategy = FedAvg(fraction_train=0.5, fraction_evaluate=1.0, min_available_nodes=2)
    # <<< strategy

    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(net.state_dict()),
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
    )
    final = result.arrays.to_torch_state_dict()
    summary = {
        "strategy": type(strategy).__name__,
        "proxy-samples": len(proxy_loader.dataset),  # type: ignore[arg-type]
        "train": {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()},
        "evaluate": {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()},
        "final-model-finite": all(
            math.isfinite(float(v.float().abs().sum())) for v in final.values()
        ),
    }
    result_file = str(context.run_config["result-file"])
    if result_file:
        Path(result_file).write_text(json.dumps(summary, default=float), encoding="utf-8")
