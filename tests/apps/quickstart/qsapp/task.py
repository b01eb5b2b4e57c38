"""qsapp: model, data and training, as Flower's quickstart-pytorch lays them out.

The data are synthetic 8x8 one-channel images of 4 classes (a class prototype plus noise), drawn
from a seed per partition, served as dict batches {"img", "label"} like the quickstart's Hugging
Face dataset, so that the app needs no download.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the quickstart's spelling)
from torch import nn
from torch.utils.data import DataLoader, Dataset

NUM_CLASSES = 4
_PROTOTYPES = torch.randn(NUM_CLASSES, 1, 8, 8, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    """A small CNN with BatchNorm (so that the rules meet buffers as well as parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        logits: torch.Tensor = self.fc(x.view(-1, 4 * 6 * 6))
        return logits


class SyntheticImages(Dataset[dict[str, torch.Tensor]]):
    """`size` labelled images drawn from `seed`, one dict {"img", "label"} per item."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, NUM_CLASSES, (size,), generator=generator)
        noise = 0.8 * torch.randn(size, 1, 8, 8, generator=generator)
        self.images = _PROTOTYPES[self.labels] + noise

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"img": self.images[index], "label": self.labels[index]}


def load_data(
    partition_id: int, num_partitions: int, batch_size: int
) -> tuple[DataLoader[dict[str, torch.Tensor]], DataLoader[dict[str, torch.Tensor]]]:
    """This node's training and validation loaders (80 / 20 of its 80 samples)."""
    partition = SyntheticImages(80, seed=1 + partition_id + 100 * num_partitions)
    train, test = torch.utils.data.random_split(
        partition, [64, 16], generator=torch.Generator().manual_seed(42)
    )
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size)


def load_proxy_data() -> DataLoader[dict[str, torch.Tensor]]:
    """100 labelled samples the server holds (FedLAW's proxy set), apart from every partition."""
    return DataLoader(SyntheticImages(100, seed=10_000), batch_size=50)


def train(
    net: nn.Module,
    trainloader: DataLoader[dict[str, torch.Tensor]],
    epochs: int,
    lr: float,
    device: torch.device,
) -> float:
    """Train the model on the training set; the mean training loss."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(
    net: nn.Module, testloader: DataLoader[dict[str, torch.Tensor]], device: torch.device
) -> tuple[float, float]:
    """Loss and accuracy on the given set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += int((outputs.argmax(1) == labels).sum().item())
    return loss / len(testloader), correct / len(testloader.dataset)  # type: ignore[arg-type]
