"""Weighted sampling across ranks, and the one-line refusal of every other ``sampler=``.

``DataLoader(dataset, sampler=WeightedRandomSampler(w, 200))`` on two ranks draws 200 samples on
each (400 per epoch where 200 were meant), and when the ranks seed alike, the same 200 twice.
:class:`WeightedDistributedSampler` makes one draw per epoch of ``num_samples`` indices from
``seed + epoch`` (the same on every rank, torch's ``torch.multinomial`` as
``WeightedRandomSampler`` draws) and splits its positions across the ranks as
``DistributedSampler`` splits a permutation, so the epoch has ``num_samples`` samples in all.
Its position resumes and re-shards like the rest of the loader (a global cursor over the
draw's positions; :class:`~ddpkit.data.shards.ResumableDistributedSampler`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils.data import WeightedRandomSampler

from ddpkit.data.shards import ResumableDistributedSampler
from ddpkit.errors import ConfigError


class WeightedDistributedSampler(ResumableDistributedSampler):
    """A ``WeightedRandomSampler``'s draw, sharded: every rank gets its part of one draw.

    Epoch ``e`` draws ``num_samples`` indices with ``torch.multinomial(weights, num_samples,
    replacement)`` under a generator seeded ``seed + e`` (the ``WeightedRandomSampler``'s own
    ``generator`` is not used: every rank must draw alike); rank ``r`` of ``W`` takes positions
    ``r, r + W, ...`` of the draw, padded (or cut, ``drop_last``) to a multiple of ``W`` as
    ``DistributedSampler`` does. ``len(sampler.dataset)`` is ``num_samples`` (the positions of
    the draw), which the loader's resume position counts.

    Args:
        weighted: the user's ``WeightedRandomSampler`` (its ``weights``, ``num_samples`` and
            ``replacement`` are used; ``num_samples`` is per epoch over all ranks).
        num_replicas, rank, seed, drop_last: as for ``DistributedSampler``.
    """

    def __init__(
        self,
        weighted: WeightedRandomSampler,
        *,
        num_replicas: int,
        rank: int,
        seed: int,
        drop_last: bool,
    ) -> None:
        self.weights = weighted.weights
        self.replacement = weighted.replacement
        super().__init__(
            range(weighted.num_samples),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=False,
            seed=seed,
            drop_last=drop_last,
        )

    def epoch_order(self) -> list[int]:
        """This epoch's draw: ``num_samples`` dataset indices, the same on every rank."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        draw = torch.multinomial(
            self.weights, self._num_draws, self.replacement, generator=generator
        )
        return draw.tolist()

    @property
    def _num_draws(self) -> int:
        # __init__ made the dataset range(num_samples): the positions of one draw.
        return len(cast(range, self.dataset))

    def __iter__(self) -> Iterator[int]:
        if self.span is None:
            self.span = (0, self.total_size)
        return super().__iter__()

    def signature(self) -> str:
        """What must agree across ranks and between a checkpoint and its resume: the weights
        (hashed), ``num_samples``, replacement."""
        data = self.weights.detach().cpu().numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=8).hexdigest()
        return f"weights {digest}, num_samples={self._num_draws}, replacement={self.replacement}"


_INSTEAD = {
    "RandomSampler": "drop sampler= (shuffle=True, the default, reshuffles every epoch)",
    "SequentialSampler": "drop sampler= and pass shuffle=False",
    "SubsetRandomSampler": "pass torch.utils.data.Subset(dataset, indices) with shuffle=True",
    "DistributedSampler": "drop sampler= (ddpkit builds the DistributedSampler itself)",
}


def take_sampler(
    dataset: Any, loader_kwargs: dict[str, Any], who: str
) -> WeightedRandomSampler | None:
    """Pop a ``WeightedRandomSampler`` out of ``loader_kwargs`` (training only); refuse any other
    ``sampler=`` or ``batch_sampler=`` in one line naming the supported way.

    Raises:
        ConfigError: another sampler, a batch sampler, a weighted sampler in evaluation, or
            weights whose length is not ``len(dataset)``, or more samples drawn without
            replacement than have a non-zero weight.
    """
    if loader_kwargs.get("batch_sampler") is not None:
        name = type(loader_kwargs["batch_sampler"]).__name__
        raise ConfigError(
            f"{who}: batch_sampler={name} is not accepted: ddpkit shards the data by rank "
            "itself, and a batch sampler would hand every rank the same batches. Pass "
            "batch_size= (and a collate_fn for items of different sizes)."
        )
    sampler = loader_kwargs.pop("sampler", None)
    if sampler is None:
        return None
    name = type(sampler).__name__
    if isinstance(sampler, WeightedRandomSampler) and who == "build_train_loader":
        if len(sampler.weights) != len(dataset):
            raise ConfigError(
                f"{who}: WeightedRandomSampler has len(weights)={len(sampler.weights)} but "
                f"len(dataset)={len(dataset)}. Give one weight per sample."
            )
        drawable = int((torch.as_tensor(sampler.weights) > 0).sum())
        if not sampler.replacement and sampler.num_samples > drawable:
            raise ConfigError(
                f"{who}: WeightedRandomSampler draws num_samples={sampler.num_samples} without "
                f"replacement from {drawable} samples of non-zero weight. Lower num_samples, or "
                "pass replacement=True."
            )
        return sampler
    if who == "build_eval_loader":
        instead = "drop sampler=: evaluation gives every sample to exactly one rank"
    else:
        instead = _INSTEAD.get(name, "use shuffle=, a Subset, or a WeightedRandomSampler")
    raise ConfigError(
        f"{who}: sampler={name} is not accepted: ddpkit shards the data across ranks itself "
        "(a sampler of your own would give every rank the same samples). "
        f"{instead[0].upper()}{instead[1:]}; weighted sampling: pass a "
        "torch.utils.data.WeightedRandomSampler to build_train_loader, which shards its draw."
    )
