"""One string-hash seed per job, and the check that every rank's ``hash(str)`` agrees.

Python salts ``hash()`` of ``str`` and ``bytes`` per process with ``PYTHONHASHSEED``, read once
when the interpreter starts (unset or ``random``: a random salt). Anything ordered by a set or by
the hash of strings then comes out in another order on every rank: class ids from
``list(set(labels))``, a vocabulary built from a set. Nothing fails; rank 1 trains "cat" as
class 3 while rank 0 calls it 7 (issue 23: 10 of 10 ids differed, test accuracy 0.35 against
0.905 with one seed).

- ``ddpkit run`` and ``ddpkit train`` give every worker of a job one ``PYTHONHASHSEED``
  (:func:`hash_seed_environment`), derived from the job's ``--rdzv-id`` (default
  ``ddpkit``), which every node's launcher already holds: the same on every node, after every
  restart and for every submission of the job (a resumed job orders its strings as the
  checkpointed one did), with no communication. A ``PYTHONHASHSEED`` already set is passed
  through unchanged.
- :func:`ddpkit.init_runtime` compares :func:`str_hash_probe` across ranks inside its rendezvous
  (:func:`ddpkit.runtime.rendezvous.join`, no extra collective), keeps the verdict in
  ``Runtime.str_hashes_agree`` and warns once, on rank 0, when the hashes differ (plain
  torchrun, srun, ``python -m torch.distributed.run`` without the variable).

A forked process keeps its parent's salt (``fork``, the test harness's forkserver ranks): its
ranks agree whatever ``PYTHONHASHSEED`` says.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from ddpkit.env import ProcessInfo
from ddpkit.log import get_logger

HASH_SEED_ENV = "PYTHONHASHSEED"
PROBE = "ddpkit-hash-probe"
MAX_HASH_SEED = 2**32 - 1  # Python accepts 0..2**32-1; 0 turns the salt off, so 1.. here


def job_hash_seed(job_id: str) -> int:
    """The ``PYTHONHASHSEED`` of job ``job_id`` (its ``--rdzv-id``): in ``[1, 2**32-1]``,
    from its sha256, so every node that knows the id derives the same one.

    Example:
        >>> 1 <= job_hash_seed("ddpkit") <= 2**32 - 1
        True
    """
    digest = hashlib.sha256(f"ddpkit-hash-seed/{job_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % MAX_HASH_SEED + 1


def hash_seed_environment(job_id: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"PYTHONHASHSEED": <job_hash_seed(job_id)>}`` for the workers, or ``{}`` when
    ``environ`` (default ``os.environ``) already sets it (``random`` included: the user's
    choice). An empty value counts as unset, as it does for Python."""
    env = os.environ if environ is None else environ
    if env.get(HASH_SEED_ENV):
        return {}
    return {HASH_SEED_ENV: str(job_hash_seed(job_id))}


def str_hash_probe() -> int:
    """``hash("ddpkit-hash-probe")`` in this process: equal on two ranks iff their salts are."""
    return hash(PROBE)


def str_hashes_warning(rank0_seed: str | None) -> str:
    """The warning rank 0 logs when the ranks' string hashes differ (``rank0_seed``: its
    ``PYTHONHASHSEED``, ``None`` when unset)."""
    seed = "unset" if rank0_seed is None else repr(rank0_seed)
    if rank0_seed == "random":
        return (
            "string hashes differ across ranks: PYTHONHASHSEED='random' gives every process its "
            "own salt. Anything ordered by set() or by the hash of strings (class ids from "
            "list(set(labels)), vocabularies) then differs per rank, silently. Set a fixed value "
            "(`export PYTHONHASHSEED=0`), or unset it under `ddpkit run`, which sets one."
        )
    return (
        f"string hashes differ across ranks: PYTHONHASHSEED={seed} on rank 0 (unset, 'random' "
        "or different on the other ranks). Anything ordered by set() or by the hash of strings "
        "(class ids from list(set(labels)), vocabularies) then differs per rank, silently. "
        "Launch with `ddpkit run` (which gives every rank one seed), or `export "
        "PYTHONHASHSEED=0` (any fixed value) before torchrun/srun."
    )


def warn_if_str_hashes_differ(info: ProcessInfo, agree: bool) -> None:
    """Log :func:`str_hashes_warning` once, on rank 0, unless ``agree``."""
    if not agree and info.is_rank_zero:
        get_logger("hashseed").warning(str_hashes_warning(os.environ.get(HASH_SEED_ENV) or None))
