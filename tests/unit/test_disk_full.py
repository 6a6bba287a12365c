"""A write that runs out of room, in one line: torch.save's own messages for it (written to
``/dev/full``, where every write fails with ENOSPC) get the disk hint; a torch write failure on a
disk with room is not called a full disk. The real full disk (a tiny tmpfs) is in
tests/cli/test_full_disk.py."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from ddpkit.diagnostics.disk import disk_full_error, format_bytes, tensor_bytes, write_failure
from ddpkit.diagnostics.translate import explain

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")

SAVE_HINT = (
    "torch.save could not write the whole file; the usual cause is a full disk or a used-up "
    "quota. Check the folder it saves to with `df -h DIR`; free space there, save to a disk "
    "with room, or keep fewer checkpoints (CheckpointManager keep_last)."
)


def _save_error(num_floats: int) -> RuntimeError:
    with pytest.raises(RuntimeError) as info:
        torch.save({"w": torch.zeros(num_floats)}, "/dev/full")
    return info.value


@pytest.mark.parametrize(
    "num_floats,message",
    [
        (1_000_000, r"\[enforce fail at inline_container.cc:\d+\] \. unexpected pos \d+ vs \d+"),
        (10, r"basic_ios::clear: iostream error"),
    ],
)
def test_torch_saves_own_words_for_a_full_disk_get_the_disk_hint(num_floats, message):
    error = _save_error(num_floats)
    assert re.fullmatch(message, str(error)), str(error)
    assert explain(error) == SAVE_HINT
    assert write_failure(error) == 0  # torch's failure: no errno to go by


def test_pythons_own_write_says_enospc_and_gets_the_full_disk_hint():
    with pytest.raises(OSError) as info, open("/dev/full", "wb") as handle:
        handle.write(b"x")
        handle.flush()
    assert info.value.errno == errno.ENOSPC and write_failure(info.value) == errno.ENOSPC
    assert explain(info.value).startswith("the disk written to is full (or its quota used up).")


def test_a_torch_write_failure_on_a_disk_with_room_is_not_called_full(tmp_path):
    # tmp_path has far more than the 4 MB the state needs: something else cut the write short
    error = _save_error(1_000_000)
    assert disk_full_error(error, tmp_path, "checkpoint step-00000001", 4_000_000) is None
    assert disk_full_error(ValueError("unrelated"), tmp_path, "x") is None


def test_the_size_of_what_needed_writing():
    model = {"w": torch.zeros(512, 512), "b": torch.zeros(512)}
    state = {"model": model, "rng": [torch.zeros(8, dtype=torch.uint8)], "step": 3}
    assert tensor_bytes(state) == 512 * 512 * 4 + 512 * 4 + 8
    assert [format_bytes(n) for n in (0, 1023, 843_152, 1_050_624, 25 * 2**30)] == [
        "0 B",
        "1023 B",
        "823.4 KiB",
        "1.0 MiB",
        "25.0 GiB",
    ]
