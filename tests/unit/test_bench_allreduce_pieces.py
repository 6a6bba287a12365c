"""The pieces of ``ddpkit bench allreduce``: sizes, the nccl-tests bus factor, the row formulas,
the result check and the memory-copy reference."""

from __future__ import annotations

import pytest
import torch

from ddpkit.bench.allreduce import (
    bus_factor,
    check_result,
    make_row,
    memcpy_gbps,
    message_sizes,
    parse_size,
)
from ddpkit.errors import ConfigError, DistributedError


@pytest.mark.parametrize(
    "text,num_bytes",
    [
        ("4096", 4096),
        ("4K", 4096),
        ("4k", 4096),
        ("4KiB", 4096),
        ("4KB", 4096),
        ("256M", 256 * 2**20),
        ("1G", 2**30),
        ("1gib", 2**30),
    ],
)
def test_parse_size_uses_powers_of_1024(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "0", "4X", "-4K", "1.5M", "K", "4 K B"])
def test_parse_size_refuses_non_sizes(text):
    with pytest.raises(ConfigError, match="invalid message size"):
        parse_size(text)


def test_message_sizes_like_nccl_tests_b_e_f():
    assert message_sizes(4096, 65536, 2) == [4096, 8192, 16384, 32768, 65536]
    assert message_sizes(4096, 65535, 2) == [4096, 8192, 16384, 32768]
    assert message_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert message_sizes(4096, 4096, 2) == [4096]
    assert len(message_sizes(parse_size("4K"), parse_size("256M"), 2)) == 17


def test_bus_factor_is_2_n_minus_1_over_n():
    assert [bus_factor(n) for n in (2, 3, 4, 8)] == [1.0, 4 / 3, 1.5, 1.75]


def test_row_formulas():
    row = make_row(2**20, 2, 0.001, 7, 4, memcpy=10.0)
    assert row["elements"] == 2**19 and row["repeats"] == 7
    assert row["time_us"] == pytest.approx(1000.0)
    assert row["algbw_gbps"] == pytest.approx(2**20 / 0.001 / 1e9)  # 1.048576 GB/s
    assert row["busbw_gbps"] == pytest.approx(1.048576 * 1.5)
    assert row["busbw_frac_memcpy"] == pytest.approx(1.048576 * 1.5 / 10.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_result_accepts_the_sum_and_names_a_corrupted_element(dtype):
    world_size = 3
    tensor = torch.full((2048,), 6.0, dtype=dtype)  # 1 + 2 + 3
    check_result(tensor, world_size, rank=1)
    tensor[1000] = 5.0
    with pytest.raises(DistributedError) as info:
        check_result(tensor, world_size, rank=1)
    message = str(info.value)
    element_bytes = tensor.element_size()
    assert message.startswith("[rank 1/3] all-reduce result wrong: ")
    assert f"bytes={2048 * element_bytes}" in message
    assert "1 of 2048 elements differ from 6 (element 1000 is 5.0)" in message


def test_check_result_catches_a_rank_that_did_not_take_part():
    tensor = torch.full((16,), 2.0)  # world size 2 but only rank 1's value arrived
    with pytest.raises(DistributedError, match="16 of 16 elements differ from 3"):
        check_result(tensor, 2)


def test_memcpy_gbps_is_positive_and_finite():
    rate = memcpy_gbps(2**20, torch.device("cpu"), repeats=3)
    assert 0 < rate < float("inf")
