"""Flower's own tests of the classes this library mirrors, run against FedAvg, FedAvgM and FedAdam.

Each test makes the calls of one test in Flower's ``framework/py/flwr/serverapp/strategy``
(``fedavgm_test.py``, ``fedopt_test.py``, and ``strategy_utils_test.py``, whose aggregation
tests are FedAvg's: Flower's ``FedAvg.aggregate_train`` is ``aggregate_arrayrecords``) with
Flower's inputs, as a Flower user's code makes them: ``current_arrays`` set by hand,
``aggregate_train`` called without ``configure_train`` before it. Expected values are Flower's,
or computed independently here (by hand, or by the installed Flower's class on the same calls);
where this library answers otherwise on purpose, the test says so and docs/library.md too.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest.mock import Mock

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower
from flwr.serverapp.exception import AggregationError

from beyond_averaging import FedAdam, FedAvg, FedAvgM

NDArray = np.ndarray[Any, Any]


def create_mock_reply(arrays: ArrayRecord, num_examples: float) -> Message:
    """Flower's ``strategy_utils_test.create_mock_reply``: a reply Message with default keys."""
    message = Mock(spec=Message)
    message.content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": num_examples})}
    )
    message.has_error.side_effect = lambda: False
    message.has_content.side_effect = lambda: True
    return message


def weighted_reply(arrays: list[NDArray], weight: float) -> Message:
    """A reply as strategy_utils_test builds its records: the weight under the key "weight"."""
    message = create_mock_reply(ArrayRecord(arrays), 1)
    message.content = RecordDict(
        {"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"weight": weight})}
    )
    return message


def numpy_arrays(record: ArrayRecord) -> list[NDArray]:
    return [np.asarray(array) for array in record.to_numpy_ndarrays()]


# ----------------------------------------------------------------------------- fedavgm_test.py
def _prepare_fedavgm() -> tuple[FedAvgM, list[Message], list[NDArray]]:
    """Flower's ``_prepare_strategy``: two replies (1 and 2 examples), the expected weighted
    mean, and a FedAvgM whose ``current_arrays`` is set to zeros by hand."""
    weights0_0 = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    weights0_1 = np.array([7, 8, 9, 10], dtype=np.float32)
    weights1_0 = np.array([[29, 23, 19], [17, 13, 11]], dtype=np.float32)
    weights1_1 = np.array([7, 5, 3, 2], dtype=np.float32)
    replies = [
        create_mock_reply(ArrayRecord([weights0_0, weights0_1]), num_examples=1),
        create_mock_reply(ArrayRecord([weights1_0, weights1_1]), num_examples=2),
    ]
    expected = [(weights0_0 * 1 + weights1_0 * 2) / 3, (weights0_1 * 1 + weights1_1 * 2) / 3]
    initial = [np.zeros((2, 3), dtype=np.float32), np.zeros(4, dtype=np.float32)]
    strategy = FedAvgM()
    strategy.current_arrays = ArrayRecord(initial)
    return strategy, replies, expected


def test_fedavgm_near_one_server_learning_rate_and_no_momentum_gives_the_weighted_mean() -> None:
    """Flower's test_aggregate_fit_using_near_one_server_lr_and_no_momentum."""
    strategy, replies, expected = _prepare_fedavgm()
    strategy.server_learning_rate = 1.0 + 1e-9

    actual, _ = strategy.aggregate_train(1, replies)

    assert actual is not None
    for w_act, w_exp in zip(numpy_arrays(actual), expected, strict=True):
        np.testing.assert_almost_equal(w_act, w_exp, decimal=5)


def test_fedavgm_near_one_learning_rate_and_near_zero_momentum_over_two_rounds() -> None:
    """Flower's test_aggregate_fit_server_learning_rate_and_momentum."""
    strategy, replies, expected = _prepare_fedavgm()
    strategy.server_learning_rate = 1.0 + 1e-9
    strategy.server_momentum = 1e-9

    actual, _ = strategy.aggregate_train(1, replies)
    actual, _ = strategy.aggregate_train(2, replies)

    assert actual is not None
    for w_act, w_exp in zip(numpy_arrays(actual), expected, strict=True):
        np.testing.assert_almost_equal(w_act, w_exp, decimal=5)


def test_fedavgm_scalar_weights_keep_their_shape() -> None:
    """Flower's test_aggregate_fit_with_scalar_weights (FedAvgM)."""
    strategy = FedAvgM(server_learning_rate=1.0 + 1e-9)
    strategy.current_arrays = ArrayRecord([np.array(0.0)])
    replies = [
        create_mock_reply(ArrayRecord([np.array(1.0)]), num_examples=1),
        create_mock_reply(ArrayRecord([np.array(3.0)]), num_examples=2),
    ]

    actual, _ = strategy.aggregate_train(1, replies)

    assert actual is not None
    scalar_weight = numpy_arrays(actual)[0]
    assert scalar_weight.shape == ()
    np.testing.assert_allclose(scalar_weight, np.array(7.0 / 3.0), rtol=1e-6)


# ----------------------------------------------------------------------------- fedopt_test.py
def _adam_first_step(
    current: dict[str, NDArray], mean: dict[str, NDArray], strategy: FedAdam
) -> dict[str, NDArray]:
    """Flower's FedAdam round 1 by hand: delta = mean - w, m = (1 - b1) delta,
    v = (1 - b2) delta^2, w + eta sqrt(1 - b2^2) / (1 - b1^2) m / (sqrt(v) + tau)."""
    eta, beta_1, beta_2, tau = 0.1, 0.9, 0.99, 1e-3  # Flower's FedAdam defaults
    assert (strategy.eta, strategy.beta_1, strategy.beta_2, strategy.tau) == (
        eta,
        beta_1,
        beta_2,
        tau,
    )
    eta_norm = eta * np.sqrt(1 - beta_2**2) / (1 - beta_1**2)
    result = {}
    for key, w in current.items():
        delta = mean[key] - w
        m_t, v_t = (1 - beta_1) * delta, (1 - beta_2) * delta**2
        result[key] = w + eta_norm * m_t / (np.sqrt(v_t) + tau)
    return result


@pytest.mark.parametrize(
    ("is_valid", "shapes", "reason"),
    [
        (True, [(7, 3)] * 4, None),  # same keys and shapes as the global model
        (False, [(7, 3)] * 5, "key-mismatch"),  # one key more
        (False, [(7, 5)] * 4, "shape-mismatch"),  # same keys, other shapes
    ],
)
def test_fedadam_replies_must_match_current_arrays(
    is_valid: bool, shapes: list[tuple[int, ...]], reason: str | None
) -> None:
    """Flower's test_compute_deltat_raises_error (FedOpt's ``current_arrays`` set by hand), through
    ``aggregate_train``: replies matching the global model give Flower's FedAdam step; replies
    with other keys or shapes do not change the model. Flower raises AggregationError there; this
    library drops such replies with the reason (counted in the round's figures) and keeps the
    model, as it does for any reply that breaks its contract (docs/library.md)."""
    rng = np.random.default_rng(0)
    global_record = ArrayRecord([rng.standard_normal((7, 3)) for _ in range(4)])
    strategy = FedAdam()
    strategy.current_arrays = {k: array.numpy() for k, array in global_record.items()}
    aggregated = ArrayRecord([rng.standard_normal(shape) for shape in shapes])
    # Two clients sending the same model: their mean is Flower's aggregated ArrayRecord.
    replies = [create_mock_reply(aggregated, 1), create_mock_reply(aggregated, 3)]

    actual, _ = strategy.aggregate_train(1, replies)

    if is_valid:
        assert actual is not None
        current = {k: array.numpy() for k, array in global_record.items()}
        mean = {k: array.numpy() for k, array in aggregated.items()}
        for key, value in _adam_first_step(current, mean, strategy).items():
            np.testing.assert_allclose(actual[key].numpy(), value, rtol=1e-6, atol=1e-9)
    else:
        assert actual is None
        assert strategy.aggregation_metrics[1][f"dropped-{reason}"] == 2


def test_fedadam_scalar_arrays_keep_their_shape_and_take_flowers_step() -> None:
    """Flower's test_fedopt_strategies_aggregate_scalar_arrays (FedAdam), with the step's value
    computed by hand as well."""
    strategy = FedAdam()
    strategy.current_arrays = {"0": np.array(0.0)}
    replies = [
        create_mock_reply(ArrayRecord([np.array(1.0)]), num_examples=1),
        create_mock_reply(ArrayRecord([np.array(3.0)]), num_examples=2),
    ]

    actual, _ = strategy.aggregate_train(1, replies)

    assert actual is not None
    scalar_weight = numpy_arrays(actual)[0]
    assert scalar_weight.shape == ()
    assert np.isfinite(scalar_weight)
    expected = _adam_first_step({"0": np.array(0.0)}, {"0": np.array(7.0 / 3.0)}, strategy)
    np.testing.assert_allclose(scalar_weight, expected["0"], rtol=1e-9)


# ----------------------------------------------------------------------------- FedAvg aggregation
def test_fedavg_averages_replies_without_configure_train() -> None:
    """Flower's test_arrayrecords_aggregation, through FedAvg.aggregate_train (which is
    aggregate_arrayrecords in Flower's FedAvg): three replies of four 7 x 3 arrays, weighted
    0.25 / 0.4 / 0.35 under the key "weight", no configure_train before."""
    weights = [0.25, 0.4, 0.35]
    rng = np.random.default_rng(1)
    np_arrays = [[rng.standard_normal((7, 3)) for _ in range(4)] for _ in range(3)]
    avg_list = [
        np.average([lst[i] for lst in np_arrays], axis=0, weights=weights) for i in range(4)
    ]
    replies = [weighted_reply(np_arrays[i], weights[i]) for i in range(3)]

    actual, _ = FedAvg(weighted_by_key="weight").aggregate_train(1, replies)

    assert actual is not None
    assert all(np.allclose(a, b) for a, b in zip(numpy_arrays(actual), avg_list, strict=True))
    assert actual.object_id == ArrayRecord(avg_list).object_id  # bit for bit, as Flower's


def test_fedavg_averages_zero_dimensional_arrays_without_configure_train() -> None:
    """Flower's test_arrayrecords_aggregation_with_ndim_zero, through FedAvg.aggregate_train."""
    weights = [0.25, 0.4, 0.35]
    rng = np.random.default_rng(2)
    np_arrays = [np.array(rng.standard_normal()) for _ in range(3)]
    expected = np.average(np_arrays, axis=0, weights=weights)
    replies = [weighted_reply([np_arrays[i]], weights[i]) for i in range(3)]

    actual, _ = FedAvg(weighted_by_key="weight").aggregate_train(1, replies)

    assert actual is not None
    result = numpy_arrays(actual)[0]
    assert result.shape == ()
    assert np.isclose(result, expected)
    assert actual.object_id == ArrayRecord([np.array(expected)]).object_id


def test_fedavg_without_configure_train_equals_flowers_fedavg() -> None:
    """The calls of Flower's fedavgm_test on plain FedAvg, beside the installed Flower's FedAvg:
    the same replies give the same model and metrics (an independent reference)."""
    _, replies, expected = _prepare_fedavgm()

    ours, our_metrics = FedAvg().aggregate_train(1, replies)
    theirs, their_metrics = flower.FedAvg().aggregate_train(1, replies)

    assert ours is not None
    assert theirs is not None
    assert list(ours) == list(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key].numpy(), theirs[key].numpy(), rtol=1e-6)
        assert ours[key].numpy().dtype == theirs[key].numpy().dtype
    for w_act, w_exp in zip(numpy_arrays(ours), expected, strict=True):
        np.testing.assert_almost_equal(w_act, w_exp, decimal=5)
    assert dict(our_metrics or {}) == dict(their_metrics or {})


@pytest.mark.parametrize(
    ("other", "reason"),
    [
        ({"b": np.ones((7, 3))}, "key-mismatch"),  # other tensor names (strategy_utils_test)
        ({"a": np.ones((7, 5))}, "shape-mismatch"),  # same names, other shapes
    ],
)
def test_without_configure_train_a_reply_unlike_the_first_is_dropped_with_the_reason(
    other: dict[str, NDArray], reason: str
) -> None:
    """Flower's test_consistency_of_replies_with_different_keys ("top-level keys match for
    ArrayRecords but not those for Arrays"): Flower's FedAvg raises InconsistentMessageReplies
    for the round; here the first reply's tensors are the reference, the reply that differs is
    dropped with its reason and the others are averaged (docs/library.md)."""
    first = {"a": np.zeros((7, 3))}
    replies = [
        create_mock_reply(ArrayRecord({k: Array(v) for k, v in first.items()}), 1),
        create_mock_reply(ArrayRecord({k: Array(v) for k, v in other.items()}), 1),
        create_mock_reply(ArrayRecord({k: Array(v + 3.0) for k, v in first.items()}), 2),
    ]

    strategy = FedAvg()
    actual, _ = strategy.aggregate_train(1, replies)

    assert actual is not None
    np.testing.assert_allclose(actual["a"].numpy(), np.full((7, 3), 2.0))  # (0 x 1 + 3 x 2) / 3
    assert strategy.aggregation_metrics[1][f"dropped-{reason}"] == 1
    assert strategy.aggregation_metrics[1]["replies-valid"] == 2


def test_without_a_global_model_the_log_says_once_which_bounds_need_it_and_how_to_give_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    strategy, replies, _ = _prepare_fedavgm()
    strategy.current_arrays = None  # as Flower's FedAvgM before configure_train
    with caplog.at_level(logging.WARNING):
        strategy.aggregate_train(1, replies)
        strategy.aggregate_train(2, replies)
    lines = [r.getMessage() for r in caplog.records if "no global model" in r.getMessage()]
    assert len(lines) == 1
    for words in ("norm filter", "direction check", "clipping", "model guard"):
        assert words in lines[0]
    assert "configure_train" in lines[0]
    assert "current_arrays" in lines[0]
    # Nothing measured against a model that was not there: no update norms in the figures.
    assert "update-norm-ratio" not in strategy.aggregation_metrics[1]
    assert strategy.aggregation_metrics[1]["aggregated"] == 1


def test_current_arrays_set_is_the_global_model_the_reply_bounds_measure_against() -> None:
    strategy, replies, _ = _prepare_fedavgm()  # current_arrays set to zeros

    strategy.aggregate_train(1, replies)

    # The two updates' norms from the zeros set by hand: 1^2 + ... + 10^2 = 385, and
    # 29^2 + 23^2 + 19^2 + 17^2 + 13^2 + 11^2 + 7^2 + 5^2 + 3^2 + 2^2 = 2397.
    norms = [np.sqrt(385.0), np.sqrt(2397.0)]
    ratio = max(norms) / np.median(norms)
    assert strategy.aggregation_metrics[1]["update-norm-ratio"] == pytest.approx(ratio)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda: FedAvgM(server_momentum=0.9), lambda: flower.FedAvgM(server_momentum=0.9)),
        (FedAdam, flower.FedAdam),
    ],
    ids=["FedAvgM", "FedAdam"],
)
def test_a_server_step_without_a_global_model_raises_aggregation_error_as_flower(
    ours: Any, theirs: Any
) -> None:
    """Flower's FedAvgM and FedOpt raise AggregationError when ``aggregate_train`` has no
    ``current_arrays`` to step from; so do these, saying how to give it."""
    _, replies, _ = _prepare_fedavgm()
    with pytest.raises(AggregationError):
        theirs().aggregate_train(1, replies)
    with pytest.raises(AggregationError, match=r"configure_train.*current_arrays"):
        ours().aggregate_train(1, replies)


# ----------------------------------------------------------------------------- Flower's attributes
def _flower_pair_replies(
    round_shift: float,
) -> tuple[dict[str, NDArray], list[Message]]:
    current = {"0": np.zeros((2, 3), np.float32), "1": np.ones(4, np.float32)}
    replies = [
        create_mock_reply(ArrayRecord([v + round_shift for v in current.values()]), 1),
        create_mock_reply(ArrayRecord([v - 2 * round_shift for v in current.values()]), 3),
    ]
    return current, replies


def _assert_records_close(ours: ArrayRecord | None, theirs: ArrayRecord | None) -> None:
    assert ours is not None
    assert theirs is not None
    assert list(ours) == list(theirs)
    for key in theirs:
        np.testing.assert_allclose(ours[key].numpy(), theirs[key].numpy(), rtol=1e-5, atol=1e-6)


def test_fedavgm_keeps_the_stepped_model_as_current_arrays_as_flower() -> None:
    """Flower's FedAvgM steps the next round from the model it returned (its current_arrays):
    two aggregate_train calls without configure_train give Flower's two models."""
    current, replies = _flower_pair_replies(1.0)
    ours = FedAvgM(server_learning_rate=0.7, server_momentum=0.9)
    theirs = flower.FedAvgM(server_learning_rate=0.7, server_momentum=0.9)
    ours.current_arrays = theirs.current_arrays = ArrayRecord(list(current.values()))
    for server_round in (1, 2):
        new, _ = ours.aggregate_train(server_round, replies)
        expected, _ = theirs.aggregate_train(server_round, replies)
        _assert_records_close(new, expected)
        _assert_records_close(ours.current_arrays, theirs.current_arrays)


def test_fedavgm_server_opt_is_fixed_at_construction_as_flower() -> None:
    """Flower's FedAvgM computes server_opt once: built with the defaults, a learning rate set
    later leaves it averaging until server_opt is set too."""
    current, replies = _flower_pair_replies(1.0)
    ours, theirs = FedAvgM(), flower.FedAvgM()
    for strategy in (ours, theirs):
        strategy.current_arrays = ArrayRecord(list(current.values()))
        strategy.server_learning_rate = 0.5
    assert ours.server_opt is theirs.server_opt is False
    _assert_records_close(
        ours.aggregate_train(1, replies)[0], theirs.aggregate_train(1, replies)[0]
    )
    for strategy in (ours, theirs):
        strategy.server_opt = True
    _assert_records_close(
        ours.aggregate_train(2, replies)[0], theirs.aggregate_train(2, replies)[0]
    )


def test_fedavgm_momentum_vector_set_by_hand_steps_as_flower() -> None:
    current, replies = _flower_pair_replies(1.0)
    vector = [np.full((2, 3), 0.5, np.float32), np.full(4, -1.0, np.float32)]
    ours = FedAvgM(server_learning_rate=0.7, server_momentum=0.9)
    theirs = flower.FedAvgM(server_learning_rate=0.7, server_momentum=0.9)
    for strategy in (ours, theirs):
        strategy.current_arrays = ArrayRecord(list(current.values()))
        strategy.momentum_vector = [v.copy() for v in vector]
    _assert_records_close(
        ours.aggregate_train(1, replies)[0], theirs.aggregate_train(1, replies)[0]
    )
    assert ours.momentum_vector is not None
    assert theirs.momentum_vector is not None
    for own, flowers in zip(ours.momentum_vector, theirs.momentum_vector, strict=True):
        np.testing.assert_allclose(own, flowers, rtol=1e-5)


def test_fedadam_moments_set_by_hand_step_as_flower() -> None:
    current, replies = _flower_pair_replies(1.0)
    m_t = {"0": np.full((2, 3), 0.2), "1": np.full(4, -0.1)}
    v_t = {"0": np.full((2, 3), 0.3), "1": np.full(4, 0.05)}
    ours, theirs = FedAdam(), flower.FedAdam()
    for strategy in (ours, theirs):
        strategy.current_arrays = dict(current)
        strategy.m_t = {k: v.copy() for k, v in m_t.items()}
        strategy.v_t = {k: v.copy() for k, v in v_t.items()}
    _assert_records_close(
        ours.aggregate_train(1, replies)[0], theirs.aggregate_train(1, replies)[0]
    )
    for name in ("m_t", "v_t"):
        own, flowers = getattr(ours, name), getattr(theirs, name)
        for key in flowers:
            np.testing.assert_allclose(own[key], flowers[key], rtol=1e-5, err_msg=name)


def test_current_arrays_takes_flowers_type_only() -> None:
    with pytest.raises(TypeError, match="ArrayRecord"):
        FedAvgM().current_arrays = {"0": np.zeros(3)}  # type: ignore[assignment]
    with pytest.raises(TypeError, match="dict"):
        FedAdam().current_arrays = ArrayRecord([np.zeros(3)])  # type: ignore[assignment]
