"""The flat app's model and its training and evaluation loops, on (x, y) tuple batches."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from tasks.data import NUM_CLASSES


class Net(nn.Module):
    """A small MLP with BatchNorm on flattened 8x8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Linear(32, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.layers(x)
        return logits


def train(
    net: nn.Module,
    trainloader: DataLoader[tuple[torch.Tensor, ...]],
    epochs: int,
    lr: float,
    device: torch.device,
) -> float:
    """Train the model on the training set; the mean training loss."""
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for features, labels in trainloader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(features.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(
    net: nn.Module, testloader: DataLoader[tuple[torch.Tensor, ...]], device: torch.device
) -> tuple[float, float]:
    """Loss and accuracy on the given set."""
    net.to(device)
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for features, labels in testloader:
            outputs = net(features.to(device))
            loss += nn.functional.cross_entropy(outputs, labels.to(device)).item()
            correct += int((outputs.argmax(1) == labels.to(device)).sum().item())
    return loss / len(testloader), correct / len(testloader.dataset)  # type: ignore[arg-type]
