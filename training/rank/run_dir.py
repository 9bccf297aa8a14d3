"""What a rank leaves in the run directory that the launcher looks for by name."""

from __future__ import annotations

from pathlib import Path

# What rank 0 writes into the run directory instead of a model when training diverged; the
# launcher turns it into one line and commits nothing.
DIVERGED_NAME = "diverged.json"
# Rank 0's epoch checkpoints (weights only), in run_dir/checkpoints.
EPOCH_CHECKPOINT = "epoch-{epoch:03d}.h5"


def last_checkpoint(checkpoints: Path) -> tuple[int, Path | None]:
    """(epochs done, weights file) of the newest epoch checkpoint, or (0, None)."""
    found = sorted(checkpoints.glob("epoch-*.h5"))
    if not found:
        return 0, None
    return int(found[-1].stem.split("-")[1]), found[-1]
