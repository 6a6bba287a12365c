"""``ddpkit bench``: measurements run side by side in one command (interleaved, medians, ratios).

- :mod:`ddpkit.bench.allreduce`: all-reduce time, algbw and busbw per message size;
- :mod:`ddpkit.bench.overhead`: the MNIST CNN step loop as raw DDP, ddpkit, Accelerate, Lightning
  Fabric and the no-sync ceiling;
- :mod:`ddpkit.bench.scaling`: throughput for 1..N processes and the scaling efficiency.

:mod:`ddpkit.bench.report` holds what they share: medians, the machine description, the table on
screen and the CSV/JSON files; :mod:`ddpkit.bench.steploop` the step loop of overhead and scaling
in every form, and :mod:`ddpkit.bench.options` their shared flags.
"""
