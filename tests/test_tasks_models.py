"""Model zoo (tasks.models) and evaluation helpers (tasks.evaluation)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from beyond_averaging.tasks.datasets import LabeledData
from beyond_averaging.tasks.evaluation import DeviceData, evaluate, resolve_device
from beyond_averaging.tasks.models import ModelName, build_model

CPU = torch.device("cpu")


def linear_layer_shapes(model: nn.Module) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)]


# --- models ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "input_shape"),
    [
        ("logreg", (1, 8, 8)),
        ("logreg", (60,)),
        ("mlp", (1, 28, 28)),
        ("mlp", (60,)),
        ("lenet5", (1, 28, 28)),
        ("lenet5", (3, 32, 32)),
        ("cnn", (1, 8, 8)),
        ("cnn", (1, 28, 28)),
        ("cnn", (3, 32, 32)),
    ],
)
def test_models_map_a_batch_to_one_logit_per_class(
    name: ModelName, input_shape: tuple[int, ...]
) -> None:
    model = build_model(name, input_shape, 7, seed=0)
    logits = model(torch.rand(5, *input_shape))
    assert logits.shape == (5, 7)


def test_mlp_is_fedlaws_784_200_200_10_network() -> None:
    model = build_model("mlp", (1, 28, 28), 10)
    assert linear_layer_shapes(model) == [(784, 200), (200, 200), (200, 10)]
    assert sum(isinstance(m, nn.ReLU) for m in model.modules()) == 2


def test_logreg_is_a_single_linear_layer_over_flattened_input() -> None:
    model = build_model("logreg", (1, 8, 8), 10)
    assert linear_layer_shapes(model) == [(64, 10)]


@pytest.mark.parametrize("input_shape", [(1, 28, 28), (3, 32, 32)])
def test_lenet5_has_the_classic_layer_sizes(input_shape: tuple[int, int, int]) -> None:
    model = build_model("lenet5", input_shape, 10)
    convolutions = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convolutions] == [
        (input_shape[0], 6, (5, 5)),
        (6, 16, (5, 5)),
    ]
    # 28x28 padded by 2 and 32x32 unpadded both reach 16 maps of 5x5 before the classifier.
    assert linear_layer_shapes(model) == [(16 * 5 * 5, 120), (120, 84), (84, 10)]


def test_lenet5_rejects_small_images_and_suggests_other_models() -> None:
    with pytest.raises(ValueError, match=re.escape("(1, 8, 8)")) as caught:
        build_model("lenet5", (1, 8, 8), 10)
    for alternative in ("cnn", "mlp", "logreg"):
        assert alternative in str(caught.value)


@pytest.mark.parametrize("name", ["lenet5", "cnn"])
def test_image_models_reject_vector_input(name: ModelName) -> None:
    with pytest.raises(ValueError, match=r"\(C, H, W\).*\(60,\).*'logreg' or 'mlp'"):
        build_model(name, (60,), 10)


def test_unknown_model_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match="logreg, mlp, lenet5, cnn"):
        build_model("resnet", (1, 8, 8), 10)  # type: ignore[arg-type]


def test_cnn_carries_batchnorm_running_statistics() -> None:
    state = build_model("cnn", (1, 8, 8), 10).state_dict()
    batchnorm_buffers = {key.rsplit(".", 1)[1] for key in state if "running" in key}
    assert batchnorm_buffers == {"running_mean", "running_var"}
    assert any(key.endswith("num_batches_tracked") for key in state)


@pytest.mark.parametrize("name", ["logreg", "mlp", "lenet5", "cnn"])
def test_seeded_models_are_identical_and_other_seeds_differ(name: ModelName) -> None:
    input_shape = (1, 28, 28)
    first = build_model(name, input_shape, 10, seed=3).state_dict()
    again = build_model(name, input_shape, 10, seed=3).state_dict()
    other = build_model(name, input_shape, 10, seed=4).state_dict()
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
    assert any(not torch.equal(value, other[key]) for key, value in first.items())


def test_seeding_a_model_leaves_the_global_random_stream_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("mlp", (60,), 10, seed=9)
    assert torch.equal(torch.rand(3), expected)


# --- device ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present, so cuda resolves")
def test_cuda_request_without_a_gpu_explains_the_alternatives() -> None:
    expected = (
        "device='cuda' was requested but torch.cuda.is_available() is False; use "
        "device='auto' or 'cpu', or install a CUDA build of torch"
    )
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        resolve_device("cuda")


def test_auto_and_cpu_requests_resolve_to_available_devices() -> None:
    assert resolve_device("cpu") == CPU
    expected_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected_auto
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_device("tpu")  # type: ignore[arg-type]


# --- data on the device --------------------------------------------------------------------


def numbered_data(num_samples: int) -> LabeledData:
    """Samples whose single feature is their position, labelled by position mod 3."""
    return LabeledData(
        np.arange(num_samples, dtype=np.float32)[:, None],
        np.arange(num_samples, dtype=np.int64) % 3,
        3,
    )


def test_device_slices_keep_sample_order_and_labels() -> None:
    data = DeviceData.from_labeled(numbered_data(10), CPU)
    batches = list(data.slices(4))
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    features = torch.cat([f for f, _ in batches])[:, 0]
    labels = torch.cat([lab for _, lab in batches])
    assert torch.equal(features, torch.arange(10, dtype=torch.float32))
    assert torch.equal(labels, torch.arange(10) % 3)
    assert labels.dtype == torch.int64


def test_device_data_accepts_read_only_arrays_without_warning_and_copies_them() -> None:
    data = numbered_data(6)
    data.features.setflags(write=False)
    data.labels.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_device = DeviceData.from_labeled(data, CPU)
    on_device.features[0, 0] = 99.0  # the cached arrays stay as they were
    assert data.features[0, 0] == 0.0
    assert on_device.input_shape == (1,)
    assert len(on_device) == 6


# --- evaluation --------------------------------------------------------------------------


def identity_logreg() -> nn.Module:
    """2-class logistic regression whose logits equal its 2-D input."""
    model = build_model("logreg", (2,), 2)
    linear = next(m for m in model.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        linear.weight.copy_(torch.eye(2))
        linear.bias.zero_()
    return model


def test_evaluate_matches_hand_computed_loss_and_accuracy() -> None:
    features = np.array([[2, 0], [0, 1], [1, 3], [3, 1]], dtype=np.float32)
    labels = np.array([0, 1, 0, 0], dtype=np.int64)
    # Logits are the inputs. Predictions 0, 1, 1, 0 -> 3 of 4 correct. With two classes the
    # cross-entropy is log(1 + exp(other logit - true logit)).
    expected_losses = [
        math.log1p(math.exp(0 - 2)),
        math.log1p(math.exp(0 - 1)),
        math.log1p(math.exp(3 - 1)),
        math.log1p(math.exp(1 - 3)),
    ]
    # batch_size 3 leaves a last batch of one: the mean must be over samples, not batches.
    loss, accuracy = evaluate(identity_logreg(), LabeledData(features, labels, 2), CPU, 3)
    assert accuracy == pytest.approx(0.75)
    assert loss == pytest.approx(sum(expected_losses) / 4, rel=1e-6)


def test_evaluate_accepts_batches_and_gives_the_same_result() -> None:
    data = LabeledData(np.array([[2, 0], [0, 1], [1, 3]], dtype=np.float32), np.array([0, 1, 1]), 2)
    model = identity_logreg()
    from_data = evaluate(model, data, CPU)
    batches = [
        (torch.from_numpy(data.features[i : i + 2]), torch.from_numpy(data.labels[i : i + 2]))
        for i in (0, 2)
    ]
    assert evaluate(model, batches, CPU) == pytest.approx(from_data)
    assert from_data[1] == pytest.approx(1.0)


def test_evaluate_restores_each_module_training_mode() -> None:
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    model.train()
    batchnorm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    batchnorm.eval()  # e.g. frozen statistics inside a model that trains
    expected_modes = [m.training for m in model.modules()]
    data = LabeledData(
        np.random.default_rng(0).random((6, 1, 8, 8), dtype=np.float32),
        np.arange(6, dtype=np.int64),
        10,
    )
    evaluate(model, data, CPU)
    assert [m.training for m in model.modules()] == expected_modes
    model.eval()
    evaluate(model, data, CPU)
    assert not any(m.training for m in model.modules())


def test_evaluate_uses_batchnorm_running_statistics_and_leaves_them_unchanged() -> None:
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    rng = np.random.default_rng(1)
    data = LabeledData(rng.random((8, 1, 8, 8), dtype=np.float32) * 5, rng.integers(0, 10, 8), 10)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.train()
    loss, accuracy = evaluate(model, data, CPU)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # The same model scored in eval mode by hand gives the same numbers.
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(data.features))
        expected_loss = float(nn.functional.cross_entropy(logits, torch.from_numpy(data.labels)))
        expected_accuracy = float(
            (logits.argmax(1) == torch.from_numpy(data.labels)).float().mean()
        )
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert accuracy == pytest.approx(expected_accuracy)


def test_evaluate_refuses_empty_data() -> None:
    empty = LabeledData(np.zeros((0, 2), dtype=np.float32), np.zeros(0, dtype=np.int64), 2)
    with pytest.raises(ValueError, match="no samples"):
        evaluate(identity_logreg(), empty, CPU)


# --- package -----------------------------------------------------------------------------


def test_package_re_exports_the_public_api() -> None:
    from beyond_averaging import tasks
    from beyond_averaging.tasks.federation import DataSpec
    from beyond_averaging.tasks.models import build_model as direct_build_model

    assert tasks.build_model is direct_build_model
    assert tasks.DataSpec is DataSpec
    assert set(tasks.__all__) <= set(dir(tasks))
    for name in tasks.__all__:
        assert getattr(tasks, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = tasks.no_such_name


def test_importing_the_protocol_module_does_not_import_torch_or_sklearn() -> None:
    # The strategies import tasks.protocol for record names only; a fresh interpreter shows
    # whether the package __init__ drags the heavy libraries in.
    probe = (
        "import sys, beyond_averaging.tasks.protocol; "
        "print(sorted(m for m in ('torch', 'sklearn', 'flwr_datasets') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"
