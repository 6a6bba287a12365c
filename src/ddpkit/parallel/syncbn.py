"""Synchronised batch norm: batch statistics over every rank's samples, on CPU/gloo and CUDA.

On CUDA, :func:`convert_sync_batchnorm` uses torch's ``nn.SyncBatchNorm.convert_sync_batchnorm``.
torch's ``SyncBatchNorm`` refuses CPU tensors ("expected input tensor to be on GPU"), so on CPU
it converts to :class:`CpuSyncBatchNorm`, which works the way Horovod's CPU SyncBatchNorm does:

- forward (training): one all-reduce of the per-channel count, sum and sum of squares (float64),
  giving the global mean and biased variance used to normalise; running_mean/running_var are
  updated like ``BatchNorm`` (running_var with the unbiased variance of the global batch) and
  num_batches_tracked is incremented;
- backward: one all-reduce of the per-channel sums of dy and dy * x_hat, from which the input
  gradient of the global batch follows. The weight and bias gradients stay local, as in torch's
  SyncBatchNorm: DDP then averages them like any other gradient;
- eval: running statistics, no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from ddpkit.errors import ConfigError
from ddpkit.log import get_logger
from ddpkit.runtime.process_group import Runtime
from ddpkit.wrappers import WRAPPERS


def _stats_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with global batch statistics; all-reduce gradient sums in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, options):
        eps, momentum, process_group = options
        dims = _stats_dims(x)
        x64 = x.detach().to(torch.float64)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64)
        packed = torch.cat([count, x64.sum(dims), (x64 * x64).sum(dims)])
        dist.all_reduce(packed, group=process_group)
        num_channels = x.shape[1]
        total = packed[0]
        if total.item() <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(total.item())} over all ranks. Use a larger batch."
            )
        mean = packed[1 : 1 + num_channels] / total
        var = (packed[1 + num_channels :] / total - mean * mean).clamp_min(0)
        if running_mean is not None:
            with torch.no_grad():
                num_batches_tracked.add_(1)
                factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
                unbiased = var * total / (total - 1)
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        invstd = (var + eps).rsqrt()
        mean, invstd = mean.to(x.dtype), invstd.to(x.dtype)
        x_hat = (x - _channel_view(mean, x)) * _channel_view(invstd, x)
        out = x_hat
        if weight is not None:
            out = x_hat * _channel_view(weight, x) + _channel_view(bias, x)
        ctx.save_for_backward(x_hat, weight, invstd)
        ctx.total = float(total)
        ctx.process_group = process_group
        ctx.has_affine = weight is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x_hat, weight, invstd = ctx.saved_tensors
        dims = _stats_dims(grad_out)
        sum_dy = grad_out.sum(dims)
        sum_dy_xhat = (grad_out * x_hat).sum(dims)
        packed = torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64)
        dist.all_reduce(packed, group=ctx.process_group)
        global_dy, global_dy_xhat = (packed / ctx.total).to(grad_out.dtype).chunk(2)
        scale = invstd if weight is None else invstd * weight
        grad_in = (
            grad_out
            - _channel_view(global_dy, grad_out)
            - x_hat * _channel_view(global_dy_xhat, grad_out)
        ) * _channel_view(scale, grad_out)
        grad_weight = sum_dy_xhat if ctx.has_affine else None
        grad_bias = sum_dy if ctx.has_affine else None
        return grad_in, grad_weight, grad_bias, None, None, None, None


# ``_BatchNorm`` is the common base of BatchNorm1d/2d/3d; torch's own convert_sync_batchnorm tests
# for it, and Horovod's SyncBatchNorm subclasses it. (Not ``nn.SyncBatchNorm``: DDP refuses that
# class on CPU modules by type.)
_BatchNorm = nn.modules.batchnorm._BatchNorm


class CpuSyncBatchNorm(_BatchNorm):
    """``BatchNorm`` whose training statistics cover every rank's batch (gloo/CPU).

    Shapes: input ``(batch, channels, *spatial)`` with any number of spatial dims (0 to 3),
    output the same. Parameters, buffers and state-dict keys are those of ``nn.BatchNorm*d``.

    Collective: in training mode, forward and backward each issue one all-reduce over
    ``process_group``; call them on every rank. Eval mode does not communicate (running
    statistics, or without them the local batch, as torch's SyncBatchNorm). Without a process
    group (world size 1) it is plain batch norm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"expected at least 2D input (batch, channels, ...): got {input.dim()}D"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training or self.process_group is None:  # eval: like torch, no sync
            return super().forward(x)
        options = (self.eps, self.momentum, self.process_group)
        running = (self.running_mean, self.running_var, self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, *running, options)


def _convert_cpu(module: nn.Module, process_group) -> nn.Module:
    """A copy-free conversion like torch's ``convert_sync_batchnorm``, to CpuSyncBatchNorm."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, CpuSyncBatchNorm):
        converted = CpuSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                converted.weight = module.weight
                converted.bias = module.bias
        if module.track_running_stats:
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
    for name, child in module.named_children():
        converted.add_module(name, _convert_cpu(child, process_group))
    return converted


def count_batchnorm(model: nn.Module) -> int:
    """Number of batch-norm layers in ``model``."""
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


def convert_sync_batchnorm(model: nn.Module, runtime: Runtime) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``model`` by a synchronised one, before DDP wrapping.

    On CUDA (the model's parameters on a CUDA device, or ``runtime.device`` CUDA) it is torch's
    ``nn.SyncBatchNorm.convert_sync_batchnorm``; on CPU, :class:`CpuSyncBatchNorm`. Both use the
    runtime's training process group. A model without batch norm is returned unchanged, with a
    log line saying so. At world size 1 batch norm already sees the whole batch: unchanged.

    Raises:
        ConfigError: ``model`` is already wrapped in DDP/DataParallel (convert before wrapping).

    Example (``wrap_model(convert_sync_batchnorm(net, rt), rt)`` on 2+ ranks; at world size 1,
    as here, the model is returned unchanged):
        >>> from ddpkit.env import ProcessInfo
        >>> net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
        >>> convert_sync_batchnorm(net, Runtime(ProcessInfo())) is net
        True
    """
    log = get_logger("parallel")
    if isinstance(model, WRAPPERS):
        raise ConfigError(
            f"sync batch norm: the model is already wrapped in {type(model).__name__}. "
            "Convert the plain module first, then wrap it."
        )
    num_bn = count_batchnorm(model)
    if num_bn == 0:
        log.info("sync batch norm: the model has no BatchNorm layer; nothing converted")
        return model
    if runtime.process_group is None:
        log.info("sync batch norm: world size 1, batch norm already sees the whole batch")
        return model
    if runtime.device.type == "cuda":
        converted = nn.SyncBatchNorm.convert_sync_batchnorm(model, runtime.process_group)
    else:
        converted = _convert_cpu(model, runtime.process_group)
    log.info("sync batch norm: converted %d BatchNorm layer(s)", num_bn)
    return converted
