"""The allowed values of the MNIST job's string settings, without torch (``ddpkit train``'s
flags and help read them before anything imports torch); :mod:`~ddpkit.app.mnist.data`,
:mod:`~ddpkit.app.mnist.model` and :mod:`~ddpkit.app.mnist.monitor` act on them."""

from __future__ import annotations

__all__ = ["DATASETS", "OPTIMIZERS", "PROGRESS_MODES", "TENSORBOARD_MODES"]

DATASETS = ("auto", "mnist", "digits")
OPTIMIZERS = ("adam", "adamw", "sgd")
PROGRESS_MODES = ("auto", "on", "off")
TENSORBOARD_MODES = ("auto", "off")
