"""A stand-in for a local trainer rank's entry point that imports nothing of moerl or torch itself
(``test_local_rank_start``): what it finds imported, the fork server imported."""

import os
import sys


def probe(conn) -> None:
    """Send (the rank's code and DTensor imported already, parent pid, ``MOERL_PROBE``) on ``conn``."""
    conn.send(
        (
            "moerl.trainer.distributed.rank" in sys.modules and "torch.distributed.tensor" in sys.modules,
            os.getppid(),
            os.environ.get("MOERL_PROBE"),
        )
    )
