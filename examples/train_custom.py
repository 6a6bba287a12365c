"""A researcher's own training loop on ddpkit's runtime: the pieces, nothing hidden.

Run it on 2 local processes, either way (the same script, unchanged):

    ddpkit run -n 2 examples/train_custom.py --epochs 3
    torchrun --standalone --nproc-per-node 2 examples/train_custom.py --epochs 3
    python examples/train_custom.py          # one process, no process group
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit


def make_splits(num_train: int, num_test: int) -> tuple[TensorDataset, TensorDataset]:
    """A learnable toy problem (the class is which of 4 input coordinates is largest), split
    into training rows and held-out test rows that training never sees."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_train + num_test, 4, generator=gen)
    y = x.argmax(dim=1)
    return TensorDataset(x[:num_train], y[:num_train]), TensorDataset(x[num_train:], y[num_train:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    with ddpkit.init_runtime() as rt:  # reads torchrun's variables; destroys the groups on exit
        ddpkit.configure_logging(rt.info)
        log = ddpkit.get_logger("example")
        print(f"rank {rt.rank} of world_size {rt.world_size} on {rt.device}", flush=True)
        torch.manual_seed(0)
        model = ddpkit.wrap_model(nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 4)), rt)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
        train_set, test_set = make_splits(2048, 500)
        train = ddpkit.build_train_loader(train_set, rt, batch_size=args.batch_size, seed=0)
        test = ddpkit.build_eval_loader(test_set, rt, batch_size=100)  # held-out rows
        for epoch in range(args.epochs):
            for x, y in train:  # the sampler's epoch advances by itself on each pass
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()  # gradients all-reduced in buckets
                optimizer.step()
            metrics = ddpkit.evaluate(model, test, rt)  # every test sample counted once
            log.info(
                "epoch %d: test accuracy %.3f on %d held-out samples",
                epoch,
                metrics["accuracy"],
                metrics["num_samples"],
            )


if __name__ == "__main__":
    main()
