"""Every rule inside Flower's central-DP wrappers: 2-round runs on the in-process Grid.

Each rule runs inside ``DifferentialPrivacyServerSideFixedClipping`` and inside
``DifferentialPrivacyClientSideFixedClipping`` with Flower's ``fixedclipping_mod`` on this project's
ClientApp (server/runtime/inprocess.py's Grid, Flower's own ``Strategy.start`` loop). A rule that
composes trains both rounds on updates clipped to ``clipping_norm`` and its model gets the wrapper's
noise; a rule that needs an extra record (Elastic, FedGMA) stops with the reason and the fix when
the wrapper's start() first calls into it (its summary()), before the initial evaluation and any
message. The last tests pin the Flower behaviour those errors rest on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.task_identity import TaskIdentity

from beyond_averaging.client.app import evaluate_local
from beyond_averaging.client.app import train as project_train
from beyond_averaging.server.app import client_task, data_spec
from beyond_averaging.server.config import RunConfig, parse_run_config
from beyond_averaging.server.runtime.inprocess import InProcessGrid
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.strategies import ClientReply, ContractStrategy, FedAdam, FedAvgM
from beyond_averaging.strategies.aggregate import NDArrayDict
from beyond_averaging.strategies.privacy import PrivacyCompositionError
from beyond_averaging.tasks.federation import load_server_splits
from beyond_averaging.tasks.models import build_model
from tests.conftest import instruction_message, reply_message

NUM_CLIENTS = 4
#: Small enough that every client's one-epoch update (norm about 1 on digits) is clipped.
CLIPPING_NORM = 0.1
NOISE_MULTIPLIER = 1.0
#: Flower's noise standard deviation: noise_multiplier * clipping_norm / num_sampled_clients.
NOISE_STD = NOISE_MULTIPLIER * CLIPPING_NORM / NUM_CLIENTS
SETTINGS: dict[str, Any] = {
    "dataset": "digits",
    "model": "mlp",
    "num-clients": NUM_CLIENTS,
    "min-train-replies": NUM_CLIENTS,
    "num-server-rounds": 2,
    "local-epochs": 1,
    "batch-size": 32,
    "device": "cpu",
    "seed": 7,
    "fedlaw-epochs": 4,
    "fedlaw-batch-size": 50,
}
WRAPPERS = {
    "server-side": DifferentialPrivacyServerSideFixedClipping,
    "client-side": DifferentialPrivacyClientSideFixedClipping,
}
#: The noise-gap warning's words (strategies/privacy.py).
NOISE_GAP = "calibrated for a plain mean of the clipped updates"


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instruction Messages read the ServerApp's task identity, set here as a run would."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


def run_config(strategy: str, **settings: Any) -> RunConfig:
    return parse_run_config({**SETTINGS, "strategy": strategy, **settings})


def build_rule(rule: str) -> tuple[ContractStrategy, RunConfig, ArrayRecord]:
    """The rule as the ServerApp builds it (FedAvgM / FedAdam under Flower's names), its run
    configuration and the initial global model."""
    by_config = {
        "FedAvg": ("fedavg", {}),
        "FedAvgM": ("fedavg", {}),
        "FedAdam": ("fedavg", {}),
        "ElasticAggregation": ("elastic", {}),
        "FedGMA": ("fedgma", {"gma-mask": "hard"}),
        "FedGMASoft": ("fedgma", {"gma-mask": "soft"}),
        "FedLAW": ("fedlaw", {}),
    }
    strategy_name, settings = by_config[rule]
    config = run_config(strategy_name, **settings)
    test_set, proxy_set = load_server_splits(data_spec(config))
    model = build_model(config.model, test_set.input_shape, test_set.num_classes, seed=config.seed)
    base: dict[str, Any] = {
        "min_train_nodes": NUM_CLIENTS,
        "min_available_nodes": NUM_CLIENTS,
        "seed": config.seed,
    }
    strategy: ContractStrategy
    if rule == "FedAvgM":
        strategy = FedAvgM(server_learning_rate=1.0, server_momentum=0.9, **base)
    elif rule == "FedAdam":
        strategy = FedAdam(eta=0.01, **base)
    else:
        strategy = build_strategy(config, ServerResources(model, proxy_set, torch.device("cpu")))
    assert type(strategy).__name__ == rule
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return strategy, config, arrays


def client_app(client_side: bool, calls: list[int] | None = None) -> ClientApp:
    """This project's ClientApp handlers, with Flower's fixedclipping_mod on train when asked."""
    app = ClientApp()

    def train(message: Message, context: Context) -> Message:
        if calls is not None:
            calls.append(context.node_id)
        return project_train(message, context)

    app.train(mods=[fixedclipping_mod] if client_side else None)(train)
    app.evaluate()(evaluate_local)
    return app


def run_wrapped(
    rule: str, side: str, calls: list[int] | None = None
) -> tuple[ContractStrategy, Any, dict[int, NDArrayDict], list[float]]:
    """Two rounds of ``rule`` inside the wrapper of ``side``.

    Returns the strategy, Flower's Result, the model the strategy returned each round (before the
    wrapper's noise) and the norm of every update the strategy aggregated.
    """
    strategy, config, arrays = build_rule(rule)
    returned: dict[int, NDArrayDict] = {}
    aggregate_train = strategy.aggregate_train

    def recording(server_round: int, replies: Iterable[Message]) -> Any:
        new, metrics = aggregate_train(server_round, replies)
        if new is not None:
            returned[server_round] = {key: array.numpy() for key, array in new.items()}
        return new, metrics

    strategy.aggregate_train = recording  # type: ignore[method-assign]
    norms: list[float] = []

    def update_norms(
        server_round: int,
        global_arrays: NDArrayDict,
        replies: Sequence[ClientReply],
        weights: np.ndarray[Any, Any],
    ) -> dict[str, float]:
        for reply in replies:
            squares = sum(
                float(np.sum((reply.arrays[k].astype(np.float64) - v) ** 2))
                for k, v in global_arrays.items()
            )
            norms.append(squares**0.5)
        return {}

    strategy.add_reply_observer(update_norms)
    wrapper = WRAPPERS[side](strategy, NOISE_MULTIPLIER, CLIPPING_NORM, NUM_CLIENTS)
    grid = InProcessGrid(client_app(side == "client-side", calls), NUM_CLIENTS, {})
    task = client_task(config).to_config()
    result = wrapper.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=2,
        train_config=ConfigRecord(dict(task)),
        evaluate_config=ConfigRecord(dict(task)),
    )
    return strategy, result, returned, norms


COMPOSING = ["FedAvg", "FedAvgM", "FedAdam", "FedGMASoft", "FedLAW"]


@pytest.mark.parametrize("side", list(WRAPPERS))
@pytest.mark.parametrize("rule", COMPOSING)
def test_rule_trains_two_rounds_on_clipped_updates_and_gets_the_wrappers_noise(
    rule: str, side: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        strategy, result, returned, norms = run_wrapped(rule, side)
    for server_round in (1, 2):
        figures = strategy.aggregation_metrics[server_round]
        assert figures["aggregated"] == 1, figures
        assert figures["replies-valid"] == NUM_CLIENTS, figures
    # The rule saw only clipped updates, and clipping bound (each one-epoch update is larger).
    assert len(norms) == 2 * NUM_CLIENTS
    assert max(norms) <= CLIPPING_NORM * (1 + 1e-4), norms
    assert min(norms) >= CLIPPING_NORM * (1 - 1e-3), norms
    # The released model is the rule's model plus Gaussian noise of Flower's standard deviation.
    noise = np.concatenate(
        [
            (result.arrays[key].numpy().astype(np.float64) - value).ravel()
            for key, value in returned[2].items()
        ]
    )
    assert noise.size > 2000
    assert abs(noise.mean()) < 4 * NOISE_STD / noise.size**0.5
    assert noise.std() == pytest.approx(NOISE_STD, rel=0.1)
    # Only the plain mean gets the noise it is calibrated for; the others say why, once a run.
    gap_warnings = caplog.text.count(NOISE_GAP)
    assert gap_warnings == (0 if rule == "FedAvg" else 1), caplog.text


@pytest.mark.parametrize("side", list(WRAPPERS))
@pytest.mark.parametrize(
    ("rule", "record", "fix"),
    [
        ("ElasticAggregation", "sensitivity", "without Flower's DP"),
        ("FedGMA", "gradient", "FedGMASoft"),
    ],
)
def test_rule_needing_an_extra_record_stops_before_round_1_naming_why_and_the_fix(
    rule: str, record: str, fix: str, side: str
) -> None:
    calls: list[int] = []
    with pytest.raises(PrivacyCompositionError) as stopped:
        run_wrapped(rule, side, calls)
    message = str(stopped.value)
    assert f"'{record}'" in message
    assert WRAPPERS[side].__name__ in message
    assert fix in message
    assert ("refuses a reply with more than one ArrayRecord" in message) == (side == "client-side")
    assert calls == []  # no client trained


@pytest.mark.parametrize(
    "wrapper",
    [DifferentialPrivacyServerSideAdaptiveClipping, DifferentialPrivacyClientSideAdaptiveClipping],
)
def test_adaptive_clipping_wrappers_stop_the_same_rules(wrapper: type[Any]) -> None:
    # They clip every ArrayRecord on the server, or need adaptiveclipping_mod (one ArrayRecord).
    for rule in ("ElasticAggregation", "FedGMA"):
        strategy, config, arrays = build_rule(rule)
        wrapped = wrapper(strategy, 0.0, NUM_CLIENTS)
        grid = InProcessGrid(client_app(False), NUM_CLIENTS, {})
        task = ConfigRecord(client_task(config).to_config())
        with pytest.raises(PrivacyCompositionError, match=wrapper.__name__):
            wrapped.start(grid=grid, initial_arrays=arrays, num_rounds=1, train_config=task)


#: Each of Flower's four central-DP wrappers around a strategy, with this file's settings.
ALL_WRAPPERS: dict[str, Callable[[Strategy], Strategy]] = {
    "server-side fixed": lambda strategy: DifferentialPrivacyServerSideFixedClipping(
        strategy, NOISE_MULTIPLIER, CLIPPING_NORM, NUM_CLIENTS
    ),
    "client-side fixed": lambda strategy: DifferentialPrivacyClientSideFixedClipping(
        strategy, NOISE_MULTIPLIER, CLIPPING_NORM, NUM_CLIENTS
    ),
    # Noise 0: their default noise on the clipped count needs more than 4 clients for 1.0.
    "server-side adaptive": lambda strategy: DifferentialPrivacyServerSideAdaptiveClipping(
        strategy, 0.0, NUM_CLIENTS
    ),
    "client-side adaptive": lambda strategy: DifferentialPrivacyClientSideAdaptiveClipping(
        strategy, 0.0, NUM_CLIENTS
    ),
}


@pytest.mark.parametrize("wrapper", list(ALL_WRAPPERS))
@pytest.mark.parametrize("rule", ["ElasticAggregation", "FedGMA"])
def test_rule_needing_an_extra_record_stops_at_start_before_the_initial_evaluation(
    rule: str, wrapper: str
) -> None:
    # The case: the error came in round 1, after the initial evaluation (and, in a
    # simulation, after Ray started). Now the run ends at Strategy.start's first call into the
    # strategy: no evaluation, no message.
    strategy, config, arrays = build_rule(rule)
    trained: list[int] = []
    evaluated: list[int] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(server_round)
        return MetricRecord({"accuracy": 0.0})

    grid = InProcessGrid(client_app(wrapper.startswith("client"), trained), NUM_CLIENTS, {})
    task = ConfigRecord(client_task(config).to_config())
    with pytest.raises(PrivacyCompositionError, match=rule):
        ALL_WRAPPERS[wrapper](strategy).start(
            grid=grid, initial_arrays=arrays, num_rounds=1, train_config=task, evaluate_fn=evaluate
        )
    assert evaluated == []
    assert trained == []


@pytest.mark.parametrize("wrapper", list(ALL_WRAPPERS))
def test_the_wrappers_summary_checks_the_composition_as_soon_as_it_is_built(wrapper: str) -> None:
    # docs/library.md: calling summary() right after building the wrapper stops there.
    strategy, _, _ = build_rule("FedGMA")
    wrapped = ALL_WRAPPERS[wrapper](strategy)
    with pytest.raises(PrivacyCompositionError, match="FedGMASoft"):
        wrapped.summary()


def test_same_rules_outside_a_wrapper_are_not_stopped() -> None:
    # The check looks for a wrapper among the callers: a direct call is the rule's own run.
    for rule in ("ElasticAggregation", "FedGMA"):
        strategy, config, arrays = build_rule(rule)
        grid = InProcessGrid(client_app(False), NUM_CLIENTS, {})
        task = ConfigRecord(client_task(config).to_config())
        strategy.summary()
        assert len(list(strategy.configure_train(1, arrays, task, grid))) == NUM_CLIENTS


# ----------------------------------------------------------------- the Flower behaviour relied on
class RecordingStrategy(Strategy):
    """Keeps the replies a wrapper hands to its strategy."""

    def __init__(self) -> None:
        self.replies: list[Message] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.replies = list(replies)
        return None, None

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        """Nothing to log."""


GLOBAL = {"w": np.full((3, 2), 0.5, np.float32), "b": np.full(2, -0.5, np.float32)}


def record(values: dict[str, np.ndarray[Any, Any]]) -> ArrayRecord:
    return ArrayRecord({key: Array(value) for key, value in values.items()})


def wrapped_replies(extra: dict[str, np.ndarray[Any, Any]]) -> Callable[[], list[Message]]:
    inner = RecordingStrategy()
    wrapper = DifferentialPrivacyServerSideFixedClipping(inner, 0.0, CLIPPING_NORM, 1)
    wrapper.configure_train(1, record(GLOBAL), ConfigRecord(), None)  # type: ignore[arg-type]
    model = {key: value + 1.0 for key, value in GLOBAL.items()}
    content = RecordDict(
        {
            "arrays": record(model),
            "sensitivity": record(extra),
            "metrics": MetricRecord({"num-examples": 5}),
        }
    )

    def aggregate() -> list[Message]:
        wrapper.aggregate_train(1, [reply_message(content)])
        return inner.replies

    return aggregate


def test_flowers_server_side_wrapper_clips_an_extra_record_as_if_it_were_the_model() -> None:
    sensitivity = {"w": np.full((3, 2), 0.01, np.float32), "b": np.full(2, 0.02, np.float32)}
    (reply,) = wrapped_replies(sensitivity)()
    seen = {key: array.numpy() for key, array in reply.content["sensitivity"].items()}  # type: ignore[union-attr]
    # By hand: w + (s - w) * min(1, C / ||s - w||), over both tensors together.
    difference = {key: sensitivity[key].astype(np.float64) - GLOBAL[key] for key in GLOBAL}
    norm = np.sqrt(sum(np.sum(d**2) for d in difference.values()))
    for key in GLOBAL:
        expected = GLOBAL[key] + difference[key] * min(1.0, CLIPPING_NORM / norm)
        np.testing.assert_allclose(seen[key], expected, rtol=1e-5)
        assert not np.allclose(seen[key], sensitivity[key])


def test_flowers_server_side_wrapper_fails_on_an_extra_record_with_fewer_tensors() -> None:
    with pytest.raises(ValueError, match="zip"):
        wrapped_replies({"w": np.full((3, 2), 0.01, np.float32)})()


def test_flowers_fixedclipping_mod_refuses_a_reply_with_a_second_array_record() -> None:
    content = RecordDict({"arrays": record(GLOBAL), "config": ConfigRecord({"clipping_norm": 1.0})})

    def answer(message: Message, context: Context) -> Message:
        reply = RecordDict(
            {
                "arrays": record(GLOBAL),
                "gradient": record(GLOBAL),
                "metrics": MetricRecord({"num-examples": 5}),
            }
        )
        return Message(content=reply, reply_to=message)

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    reply = fixedclipping_mod(instruction_message(content), context, answer)
    assert reply.has_error()
    assert "ArrayRecord" in reply.error.reason


class RoundOneReachedError(Exception):
    """Ends a run at its first configure_train: the calls before it are what is checked."""


class CallOrder(RecordingStrategy):
    """Notes the order in which a wrapper calls into it, up to round 1's configure_train."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.calls.append("configure_train")
        raise RoundOneReachedError

    def summary(self) -> None:
        """Noted."""
        self.calls.append("summary")


@pytest.mark.parametrize("wrapper", list(ALL_WRAPPERS))
def test_flowers_wrappers_call_summary_first_in_start_and_nothing_when_built(
    wrapper: str,
) -> None:
    # Where the composition check can run: a wrapper's constructor calls nothing on the
    # strategy; its start() calls the strategy's summary() before evaluate_fn(0) and round 1.
    calls: list[str] = []
    wrapped = ALL_WRAPPERS[wrapper](CallOrder(calls))
    assert calls == []

    def evaluate(server_round: int, arrays: ArrayRecord) -> None:
        calls.append(f"evaluate {server_round}")

    with pytest.raises(RoundOneReachedError):
        wrapped.start(
            grid=InProcessGrid(client_app(False), NUM_CLIENTS, {}),
            initial_arrays=record(GLOBAL),
            num_rounds=1,
            evaluate_fn=evaluate,
        )
    assert calls == ["summary", "evaluate 0", "configure_train"]


def test_flowers_privacy_accountant_refuses_every_strategy_but_its_own_fedavg() -> None:
    accounting = pytest.importorskip("flwr.supercore.privacy_accounting")
    accountant = SimpleNamespace(
        config=SimpleNamespace(sampling_method=accounting.SamplingMethod.NO_AMPLIFICATION)
    )
    strategy, _, _ = build_rule("FedAvg")
    with pytest.raises(ValueError, match=r"FedAvg\.aggregate_train"):
        DifferentialPrivacyServerSideFixedClipping(
            strategy, NOISE_MULTIPLIER, CLIPPING_NORM, NUM_CLIENTS, accountant=accountant
        )
