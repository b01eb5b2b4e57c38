"""Every rule takes Flower's FedAvg arguments, defaults and meanings; Result: client metrics."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

import beyond_averaging
from beyond_averaging import (
    ContractStrategy,
    ElasticAggregation,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedGMA,
    FedGMASoft,
    FedLAW,
)
from beyond_averaging.strategies import (
    FlowerOptions,
    ProjectOptions,
    StrategyOptions,
    aggregate_metrics,
)
from beyond_averaging.tasks.datasets import LabeledData
from tests.conftest import reply_message, train_reply

GLOBAL = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
FLOWER_FEDAVG = inspect.signature(flower.FedAvg.__init__).parameters
FLOWER_ARGUMENTS = [name for name in FLOWER_FEDAVG if name != "self"]


RULES: dict[str, Any] = {
    "FedAvg": FedAvg,
    "FedAvgM": FedAvgM,
    "FedAdam": FedAdam,
    "ElasticAggregation": ElasticAggregation,
    "FedGMA": FedGMA,
    "FedGMASoft": FedGMASoft,
    "FedLAW": lambda *flower_args, **options: FedLAW(
        *flower_args,
        model=nn.Linear(3, 2),
        proxy_set=fedlaw_proxy(),
        epochs=1,
        batch_size=10,
        **options,
    ),
}
#: Each rule's class, and the Flower class whose call shapes and attributes it must take.
FLOWER_COUNTERPART: dict[type[ContractStrategy], type[Any]] = {
    FedAvg: flower.FedAvg,
    FedAvgM: flower.FedAvgM,
    FedAdam: flower.FedAdam,
    ElasticAggregation: flower.FedAvg,
    FedGMA: flower.FedAvg,
    FedGMASoft: flower.FedAvg,
    FedLAW: flower.FedAvg,
}
#: A value other than Flower's default for each of Flower's arguments: a new argument in a
#: later Flower fails the tests below with its name, until the strategies take it.
NON_DEFAULT: dict[str, Any] = {
    "fraction_train": 0.5,
    "fraction_evaluate": 0.25,
    "min_train_nodes": 3,
    "min_evaluate_nodes": 4,
    "min_available_nodes": 5,
    "weighted_by_key": "samples",
    "arrayrecord_key": "model",
    "configrecord_key": "settings",
    "train_metrics_aggr_fn": lambda records, key: MetricRecord({"train": 1.0}),
    "evaluate_metrics_aggr_fn": lambda records, key: MetricRecord({"evaluate": 1.0}),
    "server_learning_rate": 0.7,
    "server_momentum": 0.9,
    "eta": 0.05,
    "eta_l": 0.02,
    "beta_1": 0.8,
    "beta_2": 0.95,
    "tau": 0.01,
}


def parameters(cls: type[Any]) -> list[inspect.Parameter]:
    """The constructor's parameters without ``self``."""
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


def flower_positional(cls: type[Any]) -> list[str]:
    """The arguments that Flower's ``cls`` takes by position."""
    return [p.name for p in parameters(cls) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def build(rule: type[ContractStrategy], *args: Any, **kwargs: Any) -> ContractStrategy:
    """``rule(*args, **kwargs)``, with FedLAW's required model and proxy set added."""
    factory = RULES[rule.__name__]
    strategy: ContractStrategy = factory(*args, **kwargs)
    return strategy


def fedlaw_proxy() -> LabeledData:
    rng = np.random.default_rng(0)
    return LabeledData(rng.normal(size=(20, 3)).astype(np.float32), np.arange(20) % 2, 2)


def with_global(strategy: ContractStrategy) -> ContractStrategy:
    strategy.global_arrays = {key: value.copy() for key, value in GLOBAL.items()}
    return strategy


def filled(value: float) -> dict[str, np.ndarray[Any, Any]]:
    return {key: np.full_like(array, value) for key, array in GLOBAL.items()}


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Instruction Messages read the ServerApp's task identity, set here as a run would."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


class NodeGrid:
    """A Grid that only lists nodes: enough for configure_train / configure_evaluate."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self) -> Iterable[int]:
        return list(range(1, self.count + 1))


# ----------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_every_rule_takes_flowers_fedavg_arguments_first_by_position(
    rule: type[ContractStrategy],
) -> None:
    # Names, order, kind and defaults: FedAvg(0.5) means fraction_train = 0.5 in every rule.
    theirs = parameters(flower.FedAvg)
    ours = parameters(rule)[: len(theirs)]
    assert [(p.name, p.kind, p.default) for p in ours] == [
        (p.name, p.kind, p.default) for p in theirs
    ]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in theirs)


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_every_rule_accepts_each_call_shape_of_its_flower_class(
    rule: type[ContractStrategy],
) -> None:
    # Every call that Flower's class accepts, ours accepts with the same meaning: the same names
    # and defaults; what Flower takes by position sits at the same position; what Flower takes
    # by name only ours takes by name (FedAdam's FedAvg arguments, by position too).
    theirs, ours = parameters(FLOWER_COUNTERPART[rule]), parameters(rule)
    by_name = {p.name: p for p in ours}
    for index, their in enumerate(theirs):
        assert their.name in by_name, their.name
        own = by_name[their.name]
        assert own.default == their.default, their.name
        if their.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert ours[index].name == their.name, (index, their.name)
            assert own.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, their.name
        else:
            assert own.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            ), their.name


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_rule_arguments_and_project_extras_are_keyword_only(
    rule: type[ContractStrategy],
) -> None:
    flowers = {p.name for p in parameters(FLOWER_COUNTERPART[rule])}
    for own in parameters(rule):
        if own.name not in flowers:
            assert own.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD), (
                own.name
            )
    fedavg = flower_positional(flower.FedAvg)
    positional = fedavg + [
        n for n in flower_positional(FLOWER_COUNTERPART[rule]) if n not in fedavg
    ]
    with pytest.raises(TypeError, match="positional"):
        build(rule, *[NON_DEFAULT[name] for name in positional], 1)


def public_strategies() -> set[str]:
    """The Flower strategies a user can build from ``beyond_averaging``'s exports."""
    return {
        name
        for name in beyond_averaging.__all__
        if isinstance(exported := getattr(beyond_averaging, name), type)
        and issubclass(exported, flower.Strategy)
        and not inspect.isabstract(exported)
    }


def valid_keywords(rule: type[ContractStrategy]) -> set[str]:
    """What the docs promise every rule takes by name: its own ``__init__``'s named arguments
    and this project's extras (``**options: Unpack[ProjectOptions]``)."""
    named = {p.name for p in parameters(rule) if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return named | set(ProjectOptions.__annotations__)


#: Exported strategies that wrap a rule rather than being one (their own tests say where).
WRAPPERS = {
    # The rule inside is one of RULES; its rounds, refusals and sums against each rule:
    # tests/test_secure_aggregation_rounds.py.
    "SecureAggregation",
}


def test_every_exported_strategy_is_among_the_rules_tested_here() -> None:
    assert public_strategies() == set(RULES) | WRAPPERS


@pytest.mark.parametrize(
    ("rule", "typo", "meant"),
    [
        (FedGMASoft, "thresold", "threshold"),  # the call
        (FedGMA, "treshold", "threshold"),
        (FedAvg, "fraction_trian", "fraction_train"),
        (FedAvgM, "server_lr", "server_learning_rate"),  # FedAvg's name, not FedAvgM's
        (FedAdam, "beta1", "beta_1"),
        (ElasticAggregation, "sensitivity_decy", "sensitivity_decay"),
        (FedLAW, "epoch", "epochs"),
        (FedLAW, "min_train_reply", "min_train_replies"),  # a project extra, via **options
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else value,
)
def test_misspelled_keyword_error_names_the_class_called_and_the_meant_name(
    rule: type[ContractStrategy], typo: str, meant: str
) -> None:
    with pytest.raises(TypeError) as refused:
        build(rule, **{typo: 0.5})
    assert str(refused.value) == (
        f"{rule.__name__}() got an unexpected keyword argument '{typo}'; did you mean '{meant}'?"
    )


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_every_keyword_misspelled_is_refused_in_the_rules_name(
    rule: type[ContractStrategy],
) -> None:
    for keyword in sorted(valid_keywords(rule)):
        typo = f"{keyword}x"
        with pytest.raises(TypeError) as refused:
            build(rule, **{typo: 1})
        assert str(refused.value).startswith(
            f"{rule.__name__}() got an unexpected keyword argument '{typo}'; did you mean "
            f"'{keyword}'?"
        ), str(refused.value)


def test_unknown_keyword_with_no_close_name_lists_the_accepted_ones() -> None:
    with pytest.raises(TypeError) as refused:
        FedGMASoft(colour="red")
    message = str(refused.value)
    assert message.startswith("FedGMASoft() got an unexpected keyword argument 'colour'; it takes")
    for keyword in valid_keywords(FedGMASoft):
        assert keyword in message


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_positional_errors_name_the_class_called(rule: type[ContractStrategy]) -> None:
    positional = [
        p.name for p in parameters(rule) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    values = [NON_DEFAULT[name] for name in positional]
    with pytest.raises(TypeError, match=rf"^{rule.__name__}\(\) takes {len(values)} positional"):
        build(rule, *values, 1)
    with pytest.raises(
        TypeError, match=rf"^{rule.__name__}\(\) got multiple values for argument 'fraction_train'"
    ):
        build(rule, 0.5, fraction_train=0.5)


def test_strategy_options_name_flowers_arguments_then_the_project_extras() -> None:
    flowers = [p.name for p in parameters(flower.FedAvg)]
    assert list(FlowerOptions.__annotations__) == flowers
    base = parameters(ContractStrategy)
    assert [p.name for p in base[: len(flowers)]] == flowers
    extras = [p.name for p in base[len(flowers) :]]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in base[len(flowers) :])
    assert list(ProjectOptions.__annotations__) == extras
    assert set(StrategyOptions.__annotations__) == set(flowers) | set(extras)


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_flowers_call_gives_flowers_attributes(rule: type[ContractStrategy]) -> None:
    # One call to Flower's class and to ours sets every attribute that Flower's sets, to the same
    # value. Ours takes Flower's FedAvg arguments by position even where Flower's class takes
    # them by name only (FedAdam).
    counterpart = FLOWER_COUNTERPART[rule]
    their_positional = flower_positional(counterpart)
    their_names = [p.name for p in parameters(counterpart)]
    theirs = counterpart(
        *[NON_DEFAULT[name] for name in their_positional],
        **{name: NON_DEFAULT[name] for name in their_names if name not in their_positional},
    )
    fedavg = flower_positional(flower.FedAvg)
    our_positional = fedavg + [name for name in their_positional if name not in fedavg]
    ours = build(
        rule,
        *[NON_DEFAULT[name] for name in our_positional],
        **{name: NON_DEFAULT[name] for name in their_names if name not in our_positional},
    )
    assert vars(theirs), counterpart
    for name, value in vars(theirs).items():
        assert hasattr(ours, name), name
        assert getattr(ours, name) == value, name


@pytest.mark.parametrize("rule", list(FLOWER_COUNTERPART), ids=lambda rule: rule.__name__)
def test_default_call_gives_flowers_attribute_values(rule: type[ContractStrategy]) -> None:
    theirs, ours = FLOWER_COUNTERPART[rule](), build(rule)
    for name, value in vars(theirs).items():
        if name.endswith("_metrics_aggr_fn"):
            continue  # Flower's aggregate_metricrecords; ours is checked against it below
        assert getattr(ours, name) == value, name


def test_flowers_documented_calls_work() -> None:
    assert FedAvg(0.5).fraction_train == 0.5
    assert FedAvgM(server_momentum=0.9).server_momentum == 0.9
    strategy = FedAdam(eta=0.05, eta_l=0.02, beta_1=0.8, beta_2=0.95, tau=0.01)
    assert (strategy.eta, strategy.eta_l, strategy.beta_1, strategy.beta_2, strategy.tau) == (
        0.05,
        0.02,
        0.8,
        0.95,
        0.01,
    )


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_evaluates_on_every_node_by_default_as_flower(rule: str) -> None:
    strategy = RULES[rule]()
    assert strategy.fraction_evaluate == 1.0
    messages = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), NodeGrid(5)))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3, 4, 5]


def test_min_train_nodes_and_fraction_size_the_sample_as_flower() -> None:
    # Flower samples max(int(fraction * connected), min_nodes) nodes.
    strategy = FedAvg(fraction_train=0.2, min_train_nodes=3)
    sent = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(10)))
    assert len(sent) == 3
    strategy = FedAvg(fraction_train=0.5, min_train_nodes=1)
    sent = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(10)))
    assert len(sent) == 5
    assert strategy.min_train_replies == 1  # defaults to min_train_nodes


def test_zero_fractions_skip_the_phase_as_flower() -> None:
    strategy = FedAvg(fraction_train=0.0, fraction_evaluate=0.0)
    assert strategy.min_train_nodes == strategy.min_evaluate_nodes == 0
    assert list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), NodeGrid(3))) == []
    assert list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), NodeGrid(3))) == []
    assert strategy.aggregate_train(1, []) == (None, None)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("fraction_train", 1.5),
        ("fraction_evaluate", -0.1),
        ("min_train_nodes", -1),
        ("weighted_by_key", ""),
    ],
)
def test_bad_argument_is_rejected_by_name(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        FedAvg(**{name: value})


def test_record_keys_name_the_records_sent_and_read() -> None:
    strategy = FedAvg(
        arrayrecord_key="model",
        configrecord_key="settings",
        min_train_nodes=1,
        min_available_nodes=1,
    )
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    sent = list(strategy.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), NodeGrid(1)))
    assert set(sent[0].content.array_records) == {"model"}
    assert sent[0].content.config_records["settings"]["lr"] == 0.1
    content = RecordDict(
        {
            "model": ArrayRecord({k: Array(v) for k, v in filled(2.0).items()}),
            "metrics": MetricRecord({"num-examples": 4}),
        }
    )
    new, _ = strategy.aggregate_train(1, [reply_message(content)])
    assert new is not None
    np.testing.assert_array_equal(new["w"].numpy(), filled(2.0)["w"])


def test_weighted_by_key_weighs_the_model_average() -> None:
    strategy = with_global(FedAvg(weighted_by_key="samples", min_train_replies=2))
    replies = [
        train_reply(filled(1.0), 1, metrics={"samples": 3.0}, node_id=1),
        train_reply(filled(5.0), 3, metrics={"samples": 1.0}, node_id=2),
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is not None
    np.testing.assert_allclose(new["w"].numpy(), np.full((2, 3), (3 * 1.0 + 1 * 5.0) / 4))
    assert metrics is not None
    assert metrics["num-examples"] == pytest.approx((3 * 1 + 1 * 3) / 4)  # now a plain metric


# ----------------------------------------------------------------------------- metrics
def contents(*entries: dict[str, Any]) -> list[RecordDict]:
    return [RecordDict({"metrics": MetricRecord(entry)}) for entry in entries]


def test_default_metric_aggregation_equals_flowers_when_replies_agree() -> None:
    records = contents(
        {"num-examples": 10, "loss": 0.5, "hits": 7, "per-class": [0.1, 0.9]},
        {"num-examples": 30, "loss": 1.5, "hits": 20, "per-class": [0.3, 0.5]},
    )
    ours, flowers = (
        aggregate_metrics(records, "num-examples"),
        aggregate_metricrecords(records, "num-examples"),
    )
    assert sorted(ours) == sorted(flowers)
    for key in flowers:
        assert ours[key] == pytest.approx(flowers[key])
    assert ours["loss"] == pytest.approx(1.25)  # (10 * 0.5 + 30 * 1.5) / 40, by hand
    assert type(ours["loss"]) is float


def test_metric_only_some_replies_carry_is_averaged_over_those() -> None:
    records = contents(
        {"num-examples": 10, "loss": 1.0, "extra": 4.0},
        {"num-examples": 30, "loss": 2.0},
        {"num-examples": 10, "loss": 3.0, "extra": 8.0},
    )
    result = aggregate_metrics(records, "num-examples")
    assert result["loss"] == pytest.approx((10 * 1 + 30 * 2 + 10 * 3) / 50)
    assert result["extra"] == pytest.approx(6.0)


def test_result_train_metrics_hold_only_client_metrics_as_plain_floats() -> None:
    strategy = with_global(FedAvg(min_train_replies=2))
    replies = [
        train_reply(filled(1.0), 10, metrics={"train_loss": 0.5}, node_id=1),
        train_reply(filled(2.0), 30, metrics={"train_loss": 1.5}, node_id=2),
        train_reply({"w": np.zeros(2, np.float32)}, 10, node_id=3),  # dropped: wrong keys
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None
    assert dict(metrics) == {"train_loss": pytest.approx(1.25)}
    assert "np." not in repr(dict(metrics))
    figures = strategy.aggregation_metrics[1]
    assert figures["replies-received"] == 3
    assert figures["replies-dropped"] == 1
    assert figures["aggregated"] == 1
    assert strategy.last_round_metrics == {**dict(metrics), **figures}


def test_metric_aggregation_functions_are_called_as_flower_calls_them() -> None:
    calls: list[tuple[int, str]] = []

    def custom(records: list[RecordDict], key: str) -> MetricRecord:
        calls.append((len(records), key))
        return MetricRecord({"custom": 1.0})

    strategy = with_global(
        FedAvg(train_metrics_aggr_fn=custom, evaluate_metrics_aggr_fn=custom, min_train_replies=1)
    )
    _, train = strategy.aggregate_train(
        1, [train_reply(filled(1.0), 5), train_reply(filled(2.0), 5)]
    )
    evaluation = strategy.aggregate_evaluate(
        1, [reply_message(record) for record in contents({"num-examples": 3, "acc": 0.5})]
    )
    assert dict(train or {}) == dict(evaluation or {}) == {"custom": 1.0}
    assert calls == [(2, "num-examples"), (1, "num-examples")]


def test_evaluate_metrics_are_weighted_and_error_replies_skipped() -> None:
    strategy = FedAvg()
    replies = [
        reply_message(content)
        for content in contents({"num-examples": 1, "acc": 1.0}, {"num-examples": 3, "acc": 0.0})
    ]
    replies.append(reply_message(error="ClientApp crashed"))
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics is not None
    assert dict(metrics) == {"acc": pytest.approx(0.25)}


# ----------------------------------------------------------------------------- FedAvgM / FedAdam
def _flower_state(strategy: Any) -> dict[str, Any]:
    """Flower's names for the server optimizer's state, as {name: {key: array}}."""
    if isinstance(strategy, FedAvgM | flower.FedAvgM):
        vector = strategy.momentum_vector
        return {
            "momentum_vector": None if vector is None else dict(zip(GLOBAL, vector, strict=True))
        }
    return {"m_t": strategy.m_t, "v_t": strategy.v_t}


def _assert_steps_as_flower(
    ours: Any,
    theirs: Any,
    shifts: list[tuple[float, float]],
    after_round_1: dict[str, float] | None = None,
) -> None:
    """Three rounds of two clients (10 and 30 examples) shifted from the global model by
    ``shifts``: our strategy's new global model and optimizer state (under Flower's attribute
    names) equal Flower's every round; ``after_round_1`` sets attributes of both by name."""
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    for server_round, (a, b) in enumerate(shifts, start=1):
        list(ours.configure_train(server_round, arrays, ConfigRecord(), NodeGrid(2)))
        # Flower's FedAvgM keeps an ArrayRecord of the global model, FedAdam a dict of arrays.
        current = {key: array.numpy() for key, array in arrays.items()}
        theirs.current_arrays = arrays if isinstance(theirs, flower.FedAvgM) else current
        sent = ours.current_arrays
        for key, value in current.items():
            np.testing.assert_array_equal(
                sent[key].numpy() if isinstance(sent, ArrayRecord) else sent[key], value
            )
        replies = [
            train_reply({k: (v + a).astype(np.float32) for k, v in current.items()}, 10, node_id=1),
            train_reply({k: (v + b).astype(np.float32) for k, v in current.items()}, 30, node_id=2),
        ]
        new, _ = ours.aggregate_train(server_round, replies)
        expected, _ = theirs.aggregate_train(server_round, replies)
        assert new is not None
        assert expected is not None
        for key, value in expected.items():
            np.testing.assert_allclose(new[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
        for name, state in _flower_state(theirs).items():
            own = _flower_state(ours)[name]
            assert state is not None, name
            assert own is not None, name
            assert sorted(own) == sorted(state), name
            for key, value in state.items():
                np.testing.assert_allclose(own[key], value, rtol=1e-5, atol=1e-6, err_msg=name)
        if server_round == 1:
            for name, value in (after_round_1 or {}).items():
                setattr(ours, name, value)
                setattr(theirs, name, value)
        arrays = new


def test_fedavgm_steps_exactly_as_flowers_fedavgm() -> None:
    _assert_steps_as_flower(
        FedAvgM(server_learning_rate=0.7, server_momentum=0.9, min_train_replies=2),
        flower.FedAvgM(server_learning_rate=0.7, server_momentum=0.9),
        [(1.0, 3.0), (-2.0, 4.0), (0.5, 0.0)],
    )


def test_fedavgm_attributes_changed_between_rounds_change_the_step_as_in_flower() -> None:
    _assert_steps_as_flower(
        FedAvgM(0.5, server_learning_rate=0.7, server_momentum=0.9, min_train_replies=2),
        flower.FedAvgM(0.5, server_learning_rate=0.7, server_momentum=0.9),
        [(1.0, 3.0), (-2.0, 4.0), (0.5, 0.0)],
        after_round_1={"server_learning_rate": 0.4, "server_momentum": 0.5},
    )


def test_fedadam_steps_exactly_as_flowers_fedadam() -> None:
    options = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-2}
    _assert_steps_as_flower(
        FedAdam(**options, min_train_replies=2),
        flower.FedAdam(**options),
        [(1.0, 3.0), (-1.0, 2.0), (0.5, -4.0)],
    )


def test_fedadam_attributes_changed_between_rounds_change_the_step_as_in_flower() -> None:
    options = {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-2}
    _assert_steps_as_flower(
        FedAdam(**options, min_train_replies=2),
        flower.FedAdam(**options),
        [(1.0, 3.0), (-1.0, 2.0), (0.5, -4.0)],
        after_round_1={"eta": 0.2, "beta_1": 0.5, "beta_2": 0.9, "tau": 0.1},
    )


def test_fedavg_with_adam_is_reddi_algorithm_2_without_bias_correction() -> None:
    eta, beta_1, beta_2, tau = 0.1, 0.9, 0.99, 1e-3
    strategy = FedAvg(
        server_optimizer="adam",
        server_lr=eta,
        server_beta1=beta_1,
        server_beta2=beta_2,
        server_eps=tau,
        min_train_replies=2,
    )
    current = {key: value.astype(np.float64) for key, value in GLOBAL.items()}
    first = {key: np.zeros_like(value) for key, value in current.items()}
    second = {key: np.zeros_like(value) for key, value in current.items()}
    arrays = ArrayRecord({key: Array(value) for key, value in GLOBAL.items()})
    for server_round, (a, b) in enumerate([(1.0, 3.0), (-1.0, 2.0)], start=1):
        list(strategy.configure_train(server_round, arrays, ConfigRecord(), NodeGrid(2)))
        replies = [
            train_reply({k: (current[k] + a).astype(np.float32) for k in GLOBAL}, 10, node_id=1),
            train_reply({k: (current[k] + b).astype(np.float32) for k in GLOBAL}, 30, node_id=2),
        ]
        new, _ = strategy.aggregate_train(server_round, replies)
        assert new is not None
        for key in current:  # delta = average - w
            delta = (10 * a + 30 * b) / 40 * np.ones_like(current[key])
            first[key] = beta_1 * first[key] + (1 - beta_1) * delta
            second[key] = beta_2 * second[key] + (1 - beta_2) * delta**2
            current[key] = current[key] + eta * first[key] / (np.sqrt(second[key]) + tau)
            np.testing.assert_allclose(new[key].numpy(), current[key], rtol=1e-5)
        arrays = new
