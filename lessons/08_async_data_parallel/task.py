"""The training task every run of lesson 08 shares: a small regression problem.

A fixed random "teacher" MLP labels 3072 random inputs (plus a little noise); a
student MLP of the same shape learns to imitate it with a mean-squared-error loss.
Every rank builds the same data and the same initial student from fixed seeds, so
the synchronous and the asynchronous runs start from the same point and see the same
batches: worker w's k-th gradient always uses batch(w, k), whichever way it trains.
"""

import torch
from torch import nn

DIM, HIDDEN, SAMPLES, BATCH = 16, 32, 3072, 32


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (SAMPLES x DIM) and targets (SAMPLES x 1) labelled by a fixed teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, DIM, generator=g)
    teacher = make_model(seed=seed + 1)
    with torch.no_grad():
        y = 2.0 * teacher(x) + 0.05 * torch.randn(SAMPLES, 1, generator=g)
    return x, y


def make_model(seed: int = 0) -> nn.Sequential:
    """The student (and teacher) MLP; the same weights for the same seed on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch(data, worker: int, k: int, n_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker `worker`'s k-th batch: BATCH samples drawn from its own shard (every
    n_workers-th sample, starting at `worker`), the same on every call."""
    x, y = data
    g = torch.Generator().manual_seed(1_000_003 * worker + k)
    shard = torch.arange(worker, len(x), n_workers)
    idx = shard[torch.randint(len(shard), (BATCH,), generator=g)]
    return x[idx], y[idx]


def gradient(model: nn.Module, flat_params: torch.Tensor, data, worker: int, k: int,
             n_workers: int) -> torch.Tensor:
    """The flat gradient of the loss on batch(worker, k) at flat_params.

    The asynchronous workers compute every gradient with this function, and so does
    lesson08.replay(): the same inputs give bitwise the same gradient.
    """
    torch.nn.utils.vector_to_parameters(flat_params, model.parameters())
    x, y = batch(data, worker, k, n_workers)
    loss = nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def loss_of(model: nn.Module, flat_params: torch.Tensor, data) -> float:
    """Mean-squared error on the whole data set for the parameters in flat_params."""
    torch.nn.utils.vector_to_parameters(flat_params, model.parameters())
    with torch.no_grad():
        return nn.functional.mse_loss(model(data[0]), data[1]).item()
