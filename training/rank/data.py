"""What a rank reads: its row groups of the training split, epoch by epoch, metered
(training.input), and the validation split."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from training.input import InputSpec, PartialEpoch, in_batches, load_split, make_train_dataset
from training.input_metrics import InputMeter, input_delay
from training.rank.config import WorkerConfig
from training.rank.setup import World

# Rows per batch when evaluating (validation every epoch, test at the end): inference only.
EVALUATION_BATCH = 1024
# A test hook: when "1", every rank appends each batch's row ids to rows-rank-<rank>.jsonl in
# the run folder (training.input.row_ids).
RECORD_ROWS_ENV = "SHARDFLOW_TEST_RECORD_ROWS"


class TrainInput:
    """This rank's training batches; what reading them takes is recorded in ``.meter`` (every
    rank its own, gathered after training)."""

    def __init__(
        self, config: WorkerConfig, spec: InputSpec, world: World, environ: Mapping[str, str]
    ) -> None:
        self.config = config
        self.spec = spec
        self.world = world
        self.meter = InputMeter()
        # A test hook: slows one rank's input on purpose (SHARDFLOW_TEST_INPUT_DELAY); 0 else.
        self.test_delay = input_delay(world.rank, environ)
        # A test hook: every batch's row ids, per rank, into the run folder.
        self.record_rows = (
            Path(config.run_dir) / f"rows-rank-{world.rank}.jsonl"
            if environ.get(RECORD_ROWS_ENV) == "1"
            else None
        )

    def epochs(self, first: int, last: int, partial: PartialEpoch | None = None) -> Any:
        """Epochs ``first``..``last``-1 in their planned order (a resumed run reads what it
        would have), the first of them only its rest with ``partial``."""
        train = self.config.train
        return make_train_dataset(
            self.config.source("train"),
            self.spec,
            # Horovod: this rank's row groups of the training split.
            rank=self.world.rank,
            num_ranks=self.world.num_ranks,
            batch_size=train.batch_size,
            steps_per_epoch=self.config.steps_per_epoch,
            seed=train.seed,
            shuffle_buffer=train.shuffle_buffer,
            first_epoch=first,
            epochs=last,
            meter=self.meter,
            test_delay=self.test_delay,
            partial=partial,
            record_rows=self.record_rows,
        )


def validation_data(config: WorkerConfig, spec: InputSpec) -> Any | None:
    """The validation split in evaluation batches; None when the version has none."""
    if config.validation_dir is None:
        return None
    return in_batches(load_split(config.source("validation"), spec), EVALUATION_BATCH)
