"""The MNIST CNN of ``ddpkit train`` and its optimizers."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.app.mnist.choices import OPTIMIZERS  # noqa: F401 (re-exported; torch-free)


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


class DigitsCNN(nn.Module):
    """A CNN sized for scikit-learn's 8x8 digits (1,437 training images), as the job feeds them.

    The digits arrive upsampled to 28x28 (see :func:`~ddpkit.app.mnist.data.load_digits_split`);
    a 4x4 average pool takes them back to about their own resolution, so the model has the few
    weights that 1,437 images can fit and each epoch costs about a tenth of :class:`MnistCNN`'s.

    Shapes: input ``(batch, 1, 28, 28)`` -> avgpool4 ``(batch, 1, 7, 7)`` -> conv3x3(32) -> ReLU
    -> maxpool2 ``(batch, 32, 3, 3)`` -> conv3x3(64) -> ReLU -> linear(576, 128) -> ReLU ->
    linear(128, 10) -> logits ``(batch, 10)``. Like :class:`MnistCNN`: no dropout, no batch norm.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 3 * 3, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(F.avg_pool2d(x, 4))), 2)
        return self.fc2(F.relu(self.fc1(F.relu(self.conv2(x)).flatten(1))))


MODELS = {"mnist": MnistCNN, "digits": DigitsCNN}
MODEL_NAMES = {"mnist": "the MNIST CNN", "digits": "a digits-sized CNN"}


def build_model(dataset: str = "mnist") -> nn.Module:
    """The classifier for ``dataset`` (``mnist`` or ``digits``), freshly initialised.

    Example:
        >>> build_model("digits")(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 10])
    """
    return MODELS[dataset]()


def optimizer_spec(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict]:
    """``(optimizer class, its arguments)`` of ``--optimizer NAME`` (SGD: momentum 0.9)."""
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam), {"lr": lr}


def build_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    optimizer_class, kwargs = optimizer_spec(name, lr)
    return optimizer_class(params, **kwargs)
