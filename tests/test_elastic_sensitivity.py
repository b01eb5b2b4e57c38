"""Client sensitivity: the moving average against an explicit autograd loop, and no side effects."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from torch import nn

from beyond_averaging.client.sensitivity import (
    STATE_KEY,
    compute_sensitivity,
    sensitivity_record,
    to_upload,
)
from beyond_averaging.tasks.models import build_model
from tests.conftest import instruction_message


def tiny_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Dropout(dropout), nn.Linear(5, 3)
    )
    with torch.no_grad():  # running statistics away from their defaults, to see any change
        model[1].running_mean.fill_(0.3)
        model[1].running_var.fill_(2.0)
    return model


def batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator))
        for _ in range(count)
    ]


def reference_sensitivity(
    model: nn.Module,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
    previous: dict[str, torch.Tensor] | None,
    decay: float,
) -> dict[str, torch.Tensor]:
    """The authors' loop, written out: train mode, zero grads, backprop, per-element EMA."""
    work = copy.deepcopy(model)
    work.train()
    omega = {
        name: (previous[name].clone() if previous else torch.zeros_like(p))
        for name, p in work.named_parameters()
    }
    for features, _labels in data:
        work.zero_grad()
        output = work(features)
        loss = sum(torch.sum(output[row] ** 2) for row in range(output.shape[0])) / len(output)
        loss.backward()
        for name, p in work.named_parameters():
            assert p.grad is not None
            omega[name] = decay * omega[name] + (1 - decay) * p.grad.abs()
    return omega


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-7)


def test_sensitivity_matches_an_explicit_per_batch_autograd_loop() -> None:
    model, data = tiny_model(), batches(4, seed=1)
    result = compute_sensitivity(model, data, decay=0.9)
    assert_close(result, reference_sensitivity(model, data, None, 0.9))
    assert all(result[name].shape == p.shape for name, p in model.named_parameters())


def test_moving_average_continues_over_two_rounds_on_a_new_global_model() -> None:
    model = tiny_model()
    round_one = compute_sensitivity(model, batches(3, seed=1), decay=0.8)
    with torch.no_grad():  # the next round's global model
        for p in model.parameters():
            p.add_(0.1)
    round_two = compute_sensitivity(model, batches(2, seed=2), previous=round_one, decay=0.8)
    expected_one = reference_sensitivity(tiny_model(), batches(3, seed=1), None, 0.8)
    expected_two = reference_sensitivity(model, batches(2, seed=2), expected_one, 0.8)
    assert_close(round_two, expected_two)


def test_model_is_left_exactly_as_found() -> None:
    model = tiny_model(dropout=0.5)
    model.eval()
    model[3].train()  # a mixed state: every module's own flag must come back
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    model[4].bias.grad = None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    flags = {n: m.training for n, m in model.named_modules()}
    rng_state = torch.get_rng_state()

    compute_sensitivity(model, batches(3, seed=3))

    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    for name, p in model.named_parameters():
        expected = grads[name]
        assert (p.grad is None) if expected is None else torch.equal(p.grad, expected), name
    assert {n: m.training for n, m in model.named_modules()} == flags
    assert torch.equal(torch.get_rng_state(), rng_state)  # dropout draws do not leak out


def test_frozen_parameters_get_no_sensitivity() -> None:
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    result = compute_sensitivity(model, batches(1, seed=0))
    assert "0.weight" not in result
    assert "0.bias" in result


def test_bad_decay_and_foreign_previous_are_clear_errors() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"decay = 1.0: allowed is \[0, 1\)"):
        compute_sensitivity(model, batches(1, seed=0), decay=1.0)
    with pytest.raises(ValueError, match="another model"):
        compute_sensitivity(model, batches(1, seed=0), previous={"0.weight": torch.zeros(5, 4)})


def test_float16_upload_halves_the_bytes_and_keeps_relative_sizes() -> None:
    values = torch.tensor([[1e-3, 0.5, 3.0], [0.0, 2.0, 1.0]])
    full = to_upload({"w": values}, "float32")
    half = to_upload({"w": values}, "float16")
    assert half["w"].dtype == "float16"
    payload_full, payload_half = len(full["w"].data), len(half["w"].data)
    header = payload_full - values.numel() * 4  # the .npy header, identical for both
    assert payload_half - header == values.numel() * 2
    ratio = half["w"].numpy().astype(np.float64) / 3.0
    np.testing.assert_allclose(ratio, values.numpy() / 3.0, rtol=1e-3)


def test_float16_upload_keeps_float32_for_a_tensor_beyond_its_range() -> None:
    record = to_upload({"big": torch.tensor([1.0, 1e6]), "small": torch.tensor([1.0])}, "float16")
    assert record["big"].dtype == "float32"
    assert record["small"].dtype == "float16"
    np.testing.assert_array_equal(record["big"].numpy(), [1.0, 1e6])


def train_message(config: dict[str, float | str]) -> Message:
    return instruction_message(RecordDict({"config": ConfigRecord(config)}))


def test_sensitivity_record_keeps_the_average_in_context_state_across_rounds() -> None:
    model = tiny_model()
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    config = {"sensitivity-decay": 0.7, "sensitivity-dtype": "float16"}
    first = sensitivity_record(model, batches(2, seed=1), train_message(config), context)
    second = sensitivity_record(model, batches(2, seed=2), train_message(config), context)

    expected_one = reference_sensitivity(model, batches(2, seed=1), None, 0.7)
    expected_two = reference_sensitivity(model, batches(2, seed=2), expected_one, 0.7)
    assert {array.dtype for array in second.values()} == {"float16"}
    for name, expected in expected_two.items():
        np.testing.assert_allclose(second[name].numpy(), expected.numpy(), rtol=2e-3, atol=1e-6)
        stored = context.state.array_records[STATE_KEY][name]
        assert stored.dtype == "float32"  # the running average is not rounded to float16
        np.testing.assert_allclose(stored.numpy(), expected.numpy(), rtol=1e-5, atol=1e-7)
    assert set(first) == set(expected_one)


def test_the_upload_table_in_the_elastic_docs_is_what_the_records_serialize_to() -> None:
    """docs/elastic.md ("Upload"): the bytes of the model's ``arrays`` and of the ``sensitivity``
    record in float32 and float16, as .npy payloads and as the ArrayRecord's protobuf message
    (what the Fleet API carries), recomputed here for each row's model."""
    from flwr.common.serde import array_record_to_proto

    page = (Path(__file__).resolve().parents[1] / "docs" / "elastic.md").read_text("utf-8")
    rows = [line for line in page.splitlines() if line.startswith("| mlp ")]
    assert len(rows) == 2
    torch.manual_seed(0)
    for row, shape in zip(rows, ((1, 8, 8), (784,)), strict=True):
        model = build_model("mlp", shape, 10, seed=0)
        sensitivity = compute_sensitivity(model, [torch.randn(4, *shape)])
        arrays = ArrayRecord({k: v.detach() for k, v in model.state_dict().items()})
        sizes = {}
        for dtype in ("float32", "float16"):
            record = to_upload(sensitivity, dtype)
            payload = sum(len(array.data) for array in record.values())
            sizes[dtype] = (payload, array_record_to_proto(record).ByteSize())
        count = sum(value.numel() for value in sensitivity.values())
        cells = [
            f"{count:,}",
            f"{array_record_to_proto(arrays).ByteSize():,}",
            *(f"{npy:,} / {protobuf:,}" for npy, protobuf in sizes.values()),
            f"{sizes['float16'][1] / sizes['float32'][1]:.3f}",
        ]
        assert row.split(" | ")[1:] == [*cells[:-1], cells[-1] + " |"]
