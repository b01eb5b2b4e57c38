"""pytorchexample: A Flower / PyTorch app."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')"""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


# Synthetic stand-in for CIFAR-10 (the tests run offline): the functions and batches
# below keep the quickstart's names and shapes, {"img": 3x32x32 float, "label": int}.
NUM_CLASSES = 10
PROTOTYPES = torch.randn(NUM_CLASSES, 3, 32, 32, generator=torch.Generator().manual_seed(0))


class SyntheticImages(Dataset):
    """`size` images of class `i % 10` (a class prototype plus noise), drawn from `seed`."""

    def __init__(self, size: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(size) % NUM_CLASSES
        noise = torch.randn(size, 3, 32, 32, generator=generator)
        self.images = PROTOTYPES[self.labels] + 2.0 * noise

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"img": self.images[index], "label": self.labels[index]}


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """Load partition data (synthetic in place of CIFAR-10)."""
    partition = SyntheticImages(50, seed=1 + partition_id + 1000 * num_partitions)
    # Divide data on each node: 80% train, 20% test
    train_set, test_set = random_split(partition, [40, 10], torch.Generator().manual_seed(42))
    # Construct dataloaders
    trainloader = DataLoader(train_set, batch_size=batch_size, shuffle=True)
    testloader = DataLoader(test_set, batch_size=batch_size)
    return trainloader, testloader


def load_centralized_dataset():
    """Load test set and return dataloader."""
    # Load entire test set (synthetic in place of CIFAR-10's 10,000 images)
    dataset = SyntheticImages(1000, seed=999)
    return DataLoader(dataset, batch_size=128)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)  # move model to GPU if available
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
    avg_trainloss = running_loss / (epochs * len(trainloader))
    return avg_trainloss


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            outputs = net(images)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    accuracy = correct / len(testloader.dataset)
    loss = loss / len(testloader)
    return loss, accuracy
