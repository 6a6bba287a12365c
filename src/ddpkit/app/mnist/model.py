"""The MNIST CNN of ``ddpkit train`` and its optimizers."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

OPTIMIZERS = ("adam", "adamw", "sgd")


class MnistCNN(nn.Module):
    """A small CNN for 28x28 grey images.

    Shapes: input ``(batch, 1, 28, 28)`` -> conv3x3(32) -> ReLU -> maxpool2 ``(batch, 32, 14, 14)``
    -> conv3x3(64) -> ReLU -> maxpool2 ``(batch, 64, 7, 7)`` -> linear(3136, 128) -> ReLU ->
    linear(128, 10) -> logits ``(batch, 10)``. No dropout or batch norm, so replicas and world
    sizes compute exactly the same function.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=lr)
