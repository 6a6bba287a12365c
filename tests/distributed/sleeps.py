"""A backward that takes a known time, for the tests that time step phases across ranks."""

from __future__ import annotations

import time

import torch


class SleepInBackward(torch.autograd.Function):
    """Identity in forward; sleeps ``sleep_s`` seconds in backward (``apply(x, sleep_s)``)."""

    @staticmethod
    def forward(ctx, x, sleep_s):
        ctx.sleep_s = sleep_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.sleep_s)
        return grad, None
