"""Which source rows go to which output shard and row group: a pure, deterministic plan.

Training ranks take whole row groups (petastorm assigns row group ``i`` to rank
``i % num_ranks``), so every row group of a training split holds the same number of rows and
their count is a multiple of ``rank_multiple`` (64 by default): then 1, 2, 4, ... 64 ranks all
get equal rows. Rows that do not fit that shape are either dropped from the end of the split
("drop") or the split is filled up by repeating its first rows ("pad"); the policy and the count
are recorded in the manifest. Evaluation splits are written whole.

A shard's ``start`` and ``rows`` are positions in its split's sequence of rows; which source
rows make up that sequence (a hash split, see :mod:`preprocessing.splits`) is the writer's
business. With "pad", positions at or past the split's size wrap around to its start.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from data_catalog.errors import ConfigError
from data_catalog.layout import SplitLayout, version_file


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How to cut splits into shards and row groups."""

    target_rows_per_group: int = 1000
    """Row groups are about this size (the unit a rank reads and shuffles)."""
    target_rows_per_shard: int = 10_000
    """Shards (files, one Dask task each) are about this many rows."""
    rank_multiple: int = 64
    """Image sets: training row-group counts are multiples of this, so that up to this many
    ranks (and every divisor) get equal rows. SDSS: its training split has at least this many
    row groups (smaller ones when it holds fewer rows than ``rank_multiple`` full groups)."""
    remainder: str | None = None
    """What to do with training rows that do not fill equal row groups (image sets): "drop"
    them (each remaining sample is read exactly once per epoch) or "pad" by repeating the
    first rows (every sample is read, a few twice). SDSS "keep"s them: each raw piece's last
    row group is shorter (preprocessing/sdss.py). None: the dataset's default."""

    def __post_init__(self) -> None:
        for field in ("target_rows_per_group", "target_rows_per_shard", "rank_multiple"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(field, f"must be a whole number of at least 1, got {value}")
        if self.remainder is not None and self.remainder not in REMAINDER_POLICIES:
            raise ConfigError(
                "remainder", f"{self.remainder!r} is not one of {', '.join(REMAINDER_POLICIES)}"
            )


REMAINDER_POLICIES = ("drop", "pad", "keep")
# What image sets do with rows that do not fill equal training row groups, unless told.
DEFAULT_REMAINDER = "drop"


def with_equal_groups_remainder(config: PlanConfig, dataset: str) -> PlanConfig:
    """``config`` for a split cut into equal row groups (image sets): the default remainder
    policy filled in; "keep" refused (equal groups leave no rows to keep as they are)."""
    if config.remainder is None:
        return replace(config, remainder=DEFAULT_REMAINDER)
    if config.remainder not in ("drop", "pad"):
        raise ConfigError(
            "remainder",
            f"{config.remainder!r} does not apply to {dataset}: its training row groups are "
            "equal, so the rows that do not fill them are dropped or padded (drop, pad)",
        )
    return config


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One output file: rows ``start .. start + rows`` of a split's source, in row groups."""

    split: str
    index: int
    start: int
    rows: int
    rows_per_group: int

    @property
    def path(self) -> str:
        return version_file(self.split, f"part-{self.index:05d}.parquet")

    @property
    def num_row_groups(self) -> int:
        return -(-self.rows // self.rows_per_group)


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    split: str
    source_rows: int
    rows_per_group: int
    num_row_groups: int
    dropped_rows: int
    shards: tuple[Shard, ...]
    padded_rows: int = 0
    policy: str = "whole"

    @property
    def rows(self) -> int:
        """Rows written (padding included)."""
        return self.source_rows - self.dropped_rows + self.padded_rows

    def layout(self) -> SplitLayout:
        """What the manifest records of this split."""
        return SplitLayout(
            rows=self.rows,
            source_rows=self.source_rows,
            dropped_rows=self.dropped_rows,
            padded_rows=self.padded_rows,
            rows_per_group=self.rows_per_group,
            num_row_groups=self.num_row_groups,
            num_shards=len(self.shards),
            policy=self.policy,
        )


def equal_groups(num_rows: int, config: PlanConfig) -> tuple[int, int]:
    """(rows per group, number of groups) for a training split.

    The number of groups is a multiple of ``rank_multiple``; among the shapes that drop (or
    pad) the fewest rows, the one whose group size is nearest the target wins.
    """
    multiple = config.rank_multiple
    if config.remainder == "pad":
        return _padded_groups(num_rows, config)
    if num_rows < multiple:
        raise ConfigError(
            "rank_multiple",
            f"is {multiple}, but {num_rows} training rows cannot fill {multiple} equal row "
            "groups; lower it (to a power of two no larger than the number of ranks you will "
            "train on) or add data",
        )
    best: tuple[int, int, int, int] | None = None  # (dropped, distance, rows_per_group, groups)
    num_groups = multiple
    while num_groups <= num_rows:
        rows_per_group = num_rows // num_groups
        dropped = num_rows - rows_per_group * num_groups
        key = (
            dropped,
            abs(rows_per_group - config.target_rows_per_group),
            rows_per_group,
            num_groups,
        )
        if best is None or key < best:
            best = key
        if rows_per_group < config.target_rows_per_group // 4:
            break  # far smaller groups than wanted: stop searching
        num_groups += multiple
    assert best is not None
    return best[2], best[3]


def _padded_groups(num_rows: int, config: PlanConfig) -> tuple[int, int]:
    multiple = config.rank_multiple
    if num_rows < 1:
        raise ConfigError("remainder", "is pad, but there are no training rows to pad")
    best: tuple[int, int, int, int] | None = None  # (padded, distance, rows_per_group, groups)
    num_groups = multiple
    while True:
        rows_per_group = -(-num_rows // num_groups)
        padded = rows_per_group * num_groups - num_rows
        key = (
            padded,
            abs(rows_per_group - config.target_rows_per_group),
            rows_per_group,
            num_groups,
        )
        if best is None or key < best:
            best = key
        if rows_per_group <= max(1, config.target_rows_per_group // 4):
            break
        num_groups += multiple
    return best[2], best[3]


def _cut(
    split: str, start: int, rows: int, rows_per_group: int, config: PlanConfig
) -> tuple[Shard, ...]:
    groups_per_shard = max(1, round(config.target_rows_per_shard / rows_per_group))
    rows_per_shard = groups_per_shard * rows_per_group
    shards: list[Shard] = []
    offset = 0
    while offset < rows:
        n = min(rows_per_shard, rows - offset)
        shards.append(
            Shard(
                split=split,
                index=len(shards),
                start=start + offset,
                rows=n,
                rows_per_group=rows_per_group,
            )
        )
        offset += n
    return tuple(shards)


def plan_training_split(split: str, num_rows: int, config: PlanConfig) -> SplitPlan:
    """Equal row groups, as :func:`equal_groups` cuts them (the remainder policy None: the
    default, "drop"; "keep" is refused: :func:`with_equal_groups_remainder`)."""
    config = with_equal_groups_remainder(config, "a split of equal row groups")
    assert config.remainder is not None
    rows_per_group, num_groups = equal_groups(num_rows, config)
    kept = rows_per_group * num_groups
    return SplitPlan(
        split=split,
        source_rows=num_rows,
        rows_per_group=rows_per_group,
        num_row_groups=num_groups,
        dropped_rows=max(0, num_rows - kept),
        padded_rows=max(0, kept - num_rows),
        shards=_cut(split, 0, kept, rows_per_group, config),
        policy=config.remainder,
    )


def plan_evaluation_split(split: str, num_rows: int, config: PlanConfig) -> SplitPlan:
    rows_per_group = min(config.target_rows_per_group, max(num_rows, 1))
    shards = _cut(split, 0, num_rows, rows_per_group, config)
    return SplitPlan(
        split=split,
        source_rows=num_rows,
        rows_per_group=rows_per_group,
        num_row_groups=sum(s.num_row_groups for s in shards),
        dropped_rows=0,
        shards=shards,
    )
