"""A synchronised BatchNorm built on all_reduce, for CPU (gloo) where torch's
nn.SyncBatchNorm refuses to run ("SyncBatchNorm layers only work with GPU modules").

In training mode every rank computes, for each channel, the sum and the sum of squares
of its own batch and its sample count; one all_reduce adds them up over all ranks, so
every rank normalises with the mean and variance of the *global* batch, and updates
its running statistics with the same numbers. The all_reduce is differentiable
(AllReduceSum): in backward it sums the gradients that flow into the global
statistics from every rank, so the gradients equal those of BatchNorm on the
concatenated batch.

Use the real nn.SyncBatchNorm where GPUs exist: it does the same with fused kernels
and a numerically safer variance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) that autograd can differentiate: backward is all_reduce(SUM) too."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class AllReduceBatchNorm1d(nn.BatchNorm1d):
    """nn.BatchNorm1d whose batch statistics are those of every rank's batch together."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))  # every dimension but the channels
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = AllReduceSum.apply(local)
        c = x.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean  # biased: what normalisation uses
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum
                self.running_mean.mul_(1 - m).add_(m * mean)
                self.running_var.mul_(1 - m).add_(m * var * n / (n - 1))  # unbiased, like torch
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
