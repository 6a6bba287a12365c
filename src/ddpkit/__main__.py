"""``python -m ddpkit`` = the ``ddpkit`` command (also what ``torchrun -m ddpkit train`` runs)."""

import sys

from ddpkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
