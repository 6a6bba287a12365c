"""Variable-size gathers: each rank's tensor (first dimension of any size) or any object."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit.testing import DistributedTestError, run_distributed

DTYPES = [torch.float32, torch.int64, torch.bool, torch.float64]


def _rows(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's predictions: (2r + 1 rows, or none on rank 1, of 3 columns)."""
    num_rows = 0 if rank == 1 else 2 * rank + 1
    values = torch.arange(num_rows * 3).reshape(num_rows, 3) + 100 * rank
    return (values % 2 == 0) if dtype == torch.bool else values.to(dtype)


def _gather_all(runtime) -> dict:
    tensors = {str(d): ddpkit.all_gather(_rows(runtime.rank, d), runtime) for d in DTYPES}
    scalar = ddpkit.all_gather(torch.tensor(runtime.rank * 1.5), runtime)
    empty = ddpkit.all_gather(torch.zeros(0, 4), runtime)
    objects = ddpkit.all_gather_object(
        {"rank": runtime.rank, "ids": list(range(runtime.rank))}, runtime
    )
    return {"tensors": tensors, "scalar": scalar, "empty": empty, "objects": objects}


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_returns_every_ranks_tensor_at_its_own_size(world_size):
    for result in run_distributed(_gather_all, world_size):
        for dtype in DTYPES:
            gathered = result["tensors"][str(dtype)]
            assert len(gathered) == world_size
            for rank, tensor in enumerate(gathered):
                assert tensor.dtype == dtype
                assert torch.equal(tensor, _rows(rank, dtype))
        assert [t.item() for t in result["scalar"]] == [r * 1.5 for r in range(world_size)]
        assert [t.shape for t in result["scalar"]] == [torch.Size([])] * world_size
        assert [t.shape for t in result["empty"]] == [torch.Size([0, 4])] * world_size
        assert result["objects"] == [{"rank": r, "ids": list(range(r))} for r in range(world_size)]


def _mismatched(runtime) -> None:
    columns = 3 if runtime.rank == 0 else 4
    ddpkit.all_gather(torch.zeros(2, columns), runtime)


def test_all_gather_of_different_trailing_shapes_fails_on_every_rank_naming_them():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched, 2)
    for text in info.value.failures.values():
        assert (
            "all_gather: tensors differ across ranks beyond the first dimension: "
            "rank 0 float32 (2, 3), rank 1 float32 (2, 4)."
        ) in text


def test_at_world_size_one_it_is_a_list_of_one():
    with ddpkit.init_runtime() as runtime:
        tensor = torch.arange(3)
        (gathered,) = ddpkit.all_gather(tensor, runtime)
        assert torch.equal(gathered, tensor) and gathered is not tensor
        assert ddpkit.all_gather_object("x", runtime) == ["x"]


@pytest.mark.parametrize("value", [[1.0, 2.0], 3, None])
def test_all_gather_of_a_non_tensor_names_the_type_and_the_fix(value):
    one = ddpkit.Runtime(ddpkit.ProcessInfo())
    with pytest.raises(TypeError, match=r"all_gather: tensor is a \w+: .*all_gather_object"):
        ddpkit.all_gather(value, one)  # refused alike at world size 1 and before any collective
