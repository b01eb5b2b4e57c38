"""Client helpers for any Flower ClientApp: batch formats of the sensitivity, last-step gradient."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from beyond_averaging import FedGMA, last_step_gradient, sensitivity_record
from beyond_averaging.client.sensitivity import batch_inputs, compute_sensitivity
from tests.conftest import instruction_message, reply_message


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def images(count: int = 8) -> torch.Tensor:
    return torch.randn(count, 1, 2, 2, generator=torch.Generator().manual_seed(1))


# ----------------------------------------------------------------------------- batch formats
@pytest.mark.parametrize("key", ["img", "image", "pixel_values", "x", "features"])
def test_dict_batch_with_a_known_input_key_gives_that_tensor(key: str) -> None:
    x = images()
    batch = {key: x, "label": torch.zeros(8, dtype=torch.long), "mask": torch.ones(8, 3)}
    assert batch_inputs(batch) is x


def test_dict_batch_without_known_key_gives_its_only_floating_matrix() -> None:
    x = images()
    batch = {"pixels": x, "label": torch.zeros(8, dtype=torch.long), "weight": torch.ones(8)}
    assert batch_inputs(batch) is x


@pytest.mark.parametrize(
    "batch",
    [
        {"a": torch.ones(2, 3), "b": torch.ones(2, 3)},  # two floating matrices
        {"img": torch.ones(2, 3), "x": torch.ones(2, 3)},  # two known keys
        {"label": torch.zeros(2, dtype=torch.long)},  # nothing that looks like an input
    ],
)
def test_ambiguous_dict_batch_names_input_of(batch: dict[str, torch.Tensor]) -> None:
    with pytest.raises(TypeError, match="input_of="):
        batch_inputs(batch)


def test_tuple_list_tensor_and_numpy_batches_need_no_argument() -> None:
    x = images()
    assert batch_inputs((x, torch.zeros(8))) is x
    assert batch_inputs([x, torch.zeros(8)]) is x
    assert batch_inputs(x) is x
    assert torch.equal(batch_inputs(x.numpy()), x)
    with pytest.raises(TypeError, match="input_of="):
        batch_inputs("not a batch")


def test_sensitivity_of_quickstart_dict_batches_equals_that_of_tuple_batches() -> None:
    x, y = images(), torch.arange(8) % 2
    model = net()
    as_dicts = [{"img": x[:4], "label": y[:4]}, {"img": x[4:], "label": y[4:]}]
    as_tuples = [(x[:4], y[:4]), (x[4:], y[4:])]
    explicit = compute_sensitivity(model, as_tuples, input_of=lambda batch: batch[0])
    found = compute_sensitivity(model, as_dicts)
    for name, value in explicit.items():
        torch.testing.assert_close(found[name], value)


@pytest.mark.parametrize("config_name", ["config", "settings"])  # Flower's configrecord_key
def test_sensitivity_record_takes_dict_batches_in_a_client_app(config_name: str) -> None:
    model = net()
    message = instruction_message(
        RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                config_name: ConfigRecord({"sensitivity-decay": 0.5}),
            }
        )
    )
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    loader = [{"img": images(), "label": torch.zeros(8, dtype=torch.long)}]
    record = sensitivity_record(model, loader, message, context)
    names = [name for name, _ in model.named_parameters()]
    assert list(record) == names
    # One batch from zero: Omega = (1 - decay) * |d mean ||f(x)||^2 / d theta|, computed here.
    output = model(images())
    loss = output.pow(2).sum(dim=1).mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for name, grad in zip(names, grads, strict=True):
        np.testing.assert_allclose(record[name].numpy(), 0.5 * grad.abs().numpy(), rtol=1e-5)


# ----------------------------------------------------------------------------- last-step gradient
def user_training_loop(
    model: nn.Module, steps: int, *, accumulate: int = 1, keep: list[Any] | None = None
) -> None:
    """A training loop of the user's own: SGD with momentum, weight decay and gradient clipping."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    generator = torch.Generator().manual_seed(2)
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(4, 1, 2, 2, generator=generator)
            y = torch.randint(0, 2, (4,), generator=generator)
            nn.functional.cross_entropy(model(x), y).backward()
        if keep is not None and step == steps - 1:  # the reference: .grad after the last backward
            keep.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # changes .grad in place afterwards
        optimizer.step()


@pytest.mark.parametrize("accumulate", [1, 3])
def test_last_step_gradient_is_the_gradient_of_the_last_backward_of_any_loop(
    accumulate: int,
) -> None:
    reference: list[Any] = []
    user_training_loop(net(), 5, accumulate=accumulate, keep=reference)
    model = net()
    with last_step_gradient(model) as gradient:
        user_training_loop(model, 5, accumulate=accumulate)
    record = gradient.record()
    assert list(record) == [name for name, _ in model.named_parameters()]
    for name, value in reference[0].items():
        np.testing.assert_allclose(record[name].numpy(), value.numpy(), rtol=1e-6)


def test_last_step_gradient_stops_recording_after_the_block() -> None:
    model = net()
    with last_step_gradient(model) as gradient:
        user_training_loop(model, 2)
    before = {name: array.numpy() for name, array in gradient.record().items()}
    user_training_loop(model, 3)
    for name, array in gradient.record().items():
        np.testing.assert_array_equal(array.numpy(), before[name])


def test_last_step_gradient_without_a_backward_pass_says_where_to_train() -> None:
    with last_step_gradient(net()) as gradient:
        pass
    with pytest.raises(RuntimeError, match="inside the `with last_step_gradient"):
        gradient.record()


@pytest.mark.parametrize("accumulate", [1, 3])
def test_wrapping_the_training_call_returns_its_result_and_the_last_backward_s_gradient(
    accumulate: int,
) -> None:
    reference: list[Any] = []
    user_training_loop(net(), 5, accumulate=accumulate, keep=reference)
    model = net()
    result, record = last_step_gradient.wrap(user_training_loop)(model, 5, accumulate=accumulate)
    assert result is None  # what the user's function returned, passed through
    assert list(record) == [name for name, _ in model.named_parameters()]
    for name, value in reference[0].items():
        np.testing.assert_allclose(record[name].numpy(), value.numpy(), rtol=1e-6)


def test_a_wrapped_call_leaves_no_hook_on_the_model() -> None:
    model = net()
    last_step_gradient.wrap(user_training_loop)(model, 2)
    parameter = next(model.parameters())
    assert not parameter._post_accumulate_grad_hooks  # type: ignore[attr-defined]


def test_wrap_without_one_module_among_the_arguments_asks_for_model() -> None:
    def train_global(steps: int) -> None:
        user_training_loop(model, steps)

    model = net()
    with pytest.raises(TypeError, match=r"no torch.nn.Module.*wrap\(train_global, model=model\)"):
        last_step_gradient.wrap(train_global)(2)
    with pytest.raises(TypeError, match=r"2 torch\.nn\.Modules"):
        last_step_gradient.wrap(lambda a, b: None)(net(), net())
    _, record = last_step_gradient.wrap(train_global, model=model)(2)
    assert list(record) == [name for name, _ in model.named_parameters()]


def test_fedgma_accepts_the_gradient_record_of_the_helper() -> None:
    replies = []
    for node in (1, 2):
        model = net()
        with last_step_gradient(model) as gradient:
            user_training_loop(model, node)
        content = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"num-examples": 4}),
                "gradient": gradient.record(),
            }
        )
        replies.append(reply_message(content, node_id=node))
    strategy = FedGMA(min_train_replies=2)
    strategy.global_arrays = {k: v.numpy() for k, v in net().state_dict().items()}
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None
    assert strategy.aggregation_metrics[1]["replies-valid"] == 2
