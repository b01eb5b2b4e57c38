"""FedLAW's proxy set in any form a Flower app has: Dataset, DataLoader, tensors, Hugging Face."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from beyond_averaging import FedLAW, ProxySetError
from beyond_averaging.server.config import parse_run_config
from beyond_averaging.server.strategy_factory import ServerResources, build_strategy
from beyond_averaging.tasks.datasets import LabeledData

CLASSES = 3


def proxy_arrays(count: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(count, 1, 2, 2)).astype(np.float32)
    return features, (np.arange(count) % CLASSES).astype(np.int64)


def model(outputs: int = CLASSES) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(4, outputs))


def fedlaw(proxy_set: Any, **options: Any) -> FedLAW:
    net = options.pop("net", None) or model()
    settings: dict[str, Any] = {"epochs": 1, "batch_size": 6, **options}
    return FedLAW(model=net, proxy_set=proxy_set, **settings)


def proxy_samples(strategy: FedLAW) -> tuple[np.ndarray, np.ndarray]:
    """The strategy's proxy samples, sorted so that batching order does not matter."""
    features = torch.cat([x for x, _ in strategy.proxy_batches]).numpy()
    labels = torch.cat([y for _, y in strategy.proxy_batches]).numpy()
    order = np.lexsort((features.reshape(len(features), -1).T[0], labels))
    return features[order], labels[order]


class DictSamples(Dataset[dict[str, Any]]):
    """A torch Dataset of Flower-quickstart-style samples: {"img": tensor, "label": int}."""

    def __init__(self, features: np.ndarray, labels: np.ndarray) -> None:
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"img": torch.from_numpy(self.features[index]), "label": int(self.labels[index])}


def forms() -> dict[str, Any]:
    x, y = proxy_arrays()
    tensors = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return {
        "numpy pair": (x, y),
        "tensor pair": (torch.from_numpy(x), torch.from_numpy(y)),
        "TensorDataset": tensors,
        "DataLoader": DataLoader(tensors, batch_size=5),
        "dict Dataset": DictSamples(x, y),
        "dict DataLoader": DataLoader(DictSamples(x, y), batch_size=4),
    }


@pytest.mark.parametrize("form", list(forms()))
def test_every_form_gives_the_same_proxy_samples_as_labeled_data(form: str) -> None:
    x, y = proxy_arrays()
    expected = proxy_samples(fedlaw(LabeledData(x, y, CLASSES)))
    found = proxy_samples(fedlaw(forms()[form]))
    np.testing.assert_array_equal(found[0], expected[0])
    np.testing.assert_array_equal(found[1], expected[1])


def test_hugging_face_dataset_with_the_quickstart_transform() -> None:
    datasets = pytest.importorskip("datasets")
    x, y = proxy_arrays()
    table = datasets.Dataset.from_dict({"img": x.tolist(), "label": y.tolist()})

    def apply_transforms(batch: dict[str, Any]) -> dict[str, Any]:  # as in Flower's quickstart
        batch["img"] = [torch.tensor(image, dtype=torch.float32) for image in batch["img"]]
        return batch

    found = proxy_samples(fedlaw(table, proxy_transform=apply_transforms))
    expected = proxy_samples(fedlaw((x, y)))
    np.testing.assert_allclose(found[0], expected[0])
    np.testing.assert_array_equal(found[1], expected[1])
    with pytest.raises(ProxySetError, match=r"proxy_set=.*proxy_transform="):
        fedlaw(table)  # rows hold plain lists: no tensor without the transform


@pytest.mark.parametrize(
    ("proxy_set", "message"),
    [
        ("a string", r"proxy_set= is a str"),
        ([{"pixels": torch.ones(2, 2), "mask": torch.ones(2, 2)}], r"proxy_set= .*several"),
        ((np.ones((4, 4), np.float32), np.array([0.5, 1, 2, 0])), r"class indices"),
    ],
)
def test_unreadable_proxy_set_names_the_argument(proxy_set: Any, message: str) -> None:
    with pytest.raises(ProxySetError, match=message):
        fedlaw(proxy_set)


def test_class_count_comes_from_the_model_output() -> None:
    with pytest.raises(ProxySetError, match=r"no sample of class\(es\) \[3, 4\] of the 5"):
        fedlaw(proxy_arrays(), net=model(outputs=5))


def test_proxy_smaller_than_a_batch_names_batch_size() -> None:
    with pytest.raises(ProxySetError, match=r"batch_size = 20.*set batch_size <= 12"):
        fedlaw(proxy_arrays(), batch_size=20)


def test_transform_without_a_hugging_face_dataset_is_refused() -> None:
    with pytest.raises(ProxySetError, match="proxy_transform= applies to a Hugging Face"):
        fedlaw(proxy_arrays(), proxy_transform=lambda batch: batch)


def test_overlap_with_the_test_set_is_logged_naming_both(caplog: pytest.LogCaptureFixture) -> None:
    x, y = proxy_arrays()
    test_x, test_y = proxy_arrays(count=30, seed=1)
    test_x[[3, 17, 29]] = x[[0, 5, 7]]  # three proxy images leaked into the test set
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.WARNING, logger="flwr"):
        fedlaw((x, y), test_set=(test_x, test_y))
    assert "shares 3 of its 12 samples" in caplog.text
    assert "proxy_set=" in caplog.text
    assert "test_set=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        fedlaw((x, y), test_set=proxy_arrays(count=30, seed=1))
    assert "shares" not in caplog.text


def test_server_app_factory_checks_the_proxy_set_against_its_test_split(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rng = np.random.default_rng(3)
    proxy = LabeledData(rng.normal(size=(100, 1, 8, 8)).astype(np.float32), np.arange(100) % 10, 10)
    test = LabeledData(
        np.concatenate([proxy.features[:4], proxy.features[:4] + 1]), np.zeros(8, np.int64), 10
    )
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    config = parse_run_config({"strategy": "fedlaw", "fedlaw-epochs": 1})
    logging.getLogger("flwr").propagate = True
    with caplog.at_level(logging.WARNING, logger="flwr"):
        build_strategy(config, ServerResources(net, proxy, torch.device("cpu"), test))
    assert "shares 4 of its 100 samples" in caplog.text
