"""Pairwise (gossip) weight averaging: ``--sync pairwise``.

    every rank: local step (its own gradients, plain optimizer) ─┐  x K (--average-every)
                                                                 ▼
    round r of the schedule: rank ─ partner(rank, r) ─ allreduce(Average) of the two ranks'
    weights on their process set (Horovod, 2 ranks) ─ both hold the same weights; next round

The schedule is a 1-factorisation of the complete graph on the ranks (the circle method): in
each round every rank is in at most one pair, and over :func:`num_rounds` rounds every rank
meets every other exactly once; with an odd number of ranks one rank sits out each round. The
rounds repeat, so information from every rank reaches every other.

:func:`pairing_rounds` and :func:`partner` are pure; :func:`pair_process_sets` makes the static
Horovod process sets (one per pair, registered at ``collective.init``: :func:`registered`) and
:func:`pairwise_averaging` is the Keras callback that averages.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

Pair = tuple[int, int]


def num_rounds(num_ranks: int) -> int:
    """Rounds after which every rank has met every other once: N-1 for even N, N for odd N
    (every rank then sits out once)."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if num_ranks == 1:
        return 1
    return num_ranks - 1 if num_ranks % 2 == 0 else num_ranks


def pairing_rounds(num_ranks: int) -> tuple[tuple[Pair, ...], ...]:
    """The pairs of each round (each pair as (lower rank, higher rank), sorted).

    Circle method: with M = N (even) or N + 1 (odd, rank N being "sits out"), rank M-1 stays
    put and the others turn round a circle of M-1 places; in round r it meets r, and the
    places r+k and r-k meet each other. One rank alone has no pair."""
    rounds = num_rounds(num_ranks)
    if num_ranks == 1:
        return ((),)
    places = num_ranks if num_ranks % 2 == 0 else num_ranks + 1
    circle = places - 1
    schedule = []
    for r in range(rounds):
        pairs = [(places - 1, r)]
        pairs += [((r + k) % circle, (r - k) % circle) for k in range(1, places // 2)]
        schedule.append(
            tuple(sorted((min(a, b), max(a, b)) for a, b in pairs if max(a, b) < num_ranks))
        )
    return tuple(schedule)


def partner(rank: int, num_ranks: int, average_index: int) -> int | None:
    """The rank that ``rank`` averages with at its ``average_index``-th average (from 0), or
    None when it sits out that round."""
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is not one of {num_ranks} ranks")
    rounds = pairing_rounds(num_ranks)
    for a, b in rounds[average_index % len(rounds)]:
        if rank in (a, b):
            return b if rank == a else a
    return None


def all_pairs(num_ranks: int) -> tuple[Pair, ...]:
    """Every pair of ranks, in the order every rank registers their process sets."""
    return tuple(itertools.combinations(range(num_ranks), 2))


def pair_process_sets(num_ranks: int) -> dict[Pair, Any]:
    """A Horovod ``ProcessSet`` per pair of ranks: static process sets, the same list on every
    rank, registered with :func:`registered` (no HOROVOD_DYNAMIC_PROCESS_SETS). With two ranks
    the pair is every rank: Horovod's global process set (Horovod refuses to register a set
    equal to it)."""
    from training import collective

    if num_ranks == 2:
        return {(0, 1): collective.global_process_set()}
    return {pair: collective.process_set(pair) for pair in all_pairs(num_ranks)}


def registered(process_sets: dict[Pair, Any]) -> list[Any]:
    """What to pass as ``collective.init(process_sets)``: every set but the global one."""
    from training import collective

    every = collective.global_process_set()
    return [s for s in process_sets.values() if s is not every]


def averaged_variables(model: Any) -> list[Any]:
    """The variables that pairwise averaging mixes: every floating-point variable of the model,
    trainable or not (batch-norm moving statistics; the constant normalisation layer, equal
    everywhere). Integer state (the random layers' generator counters, each rank its own) and
    the optimizer's slots are left alone."""
    return [v for v in model.variables if v.dtype.is_floating]


def average_with(variables: Sequence[Any], process_set: Any, name: str) -> int:
    """Replace ``variables`` by their mean over the ranks of ``process_set`` (one grouped
    allreduce); returns the payload bytes handed to Horovod."""
    import tensorflow as tf

    from training import collective

    tensors = [tf.convert_to_tensor(v) for v in variables]
    averaged = collective.average(tensors, process_set, name)
    for variable, value in zip(variables, averaged, strict=True):
        variable.assign(value)
    return sum(int(t.shape.num_elements()) * t.dtype.size for t in tensors)


def pairwise_averaging(rank: int, num_ranks: int, every: int, process_sets: dict[Pair, Any]) -> Any:
    """A Keras callback: after every ``every`` steps (counted across epochs) this rank
    averages its weights (:func:`averaged_variables`) with its partner of the round
    (:func:`partner`), on their pair's process set. ``.bytes_by_epoch``: the payload it handed
    to Horovod in each epoch; ``.averages``: averaging rounds passed, ``.partnered``: rounds it
    took part in."""
    import tensorflow as tf

    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")

    class PairwiseAveraging(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._supports_tf_logs = True  # its batch hook reads no logs
            self.bytes_by_epoch: list[int] = []
            self.averages = 0
            self.partnered = 0
            self._steps = 0
            self._epoch_bytes = 0
            self._variables: list[Any] = []

        def set_model(self, model: Any) -> None:
            super().set_model(model)
            self._variables = averaged_variables(model)

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._epoch_bytes = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._steps += 1
            if self._steps % every:
                return
            other = partner(rank, num_ranks, self.averages)
            self.averages += 1
            if other is None:
                return
            pair = (min(rank, other), max(rank, other))
            # Horovod: the two ranks of the pair, and only they, average their weights.
            self._epoch_bytes += average_with(
                self._variables, process_sets[pair], f"pairwise_{pair[0]}_{pair[1]}"
            )
            self.partnered += 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.bytes_by_epoch.append(self._epoch_bytes)

        def report(self) -> dict[str, Any]:
            return {
                "bytes_by_epoch": self.bytes_by_epoch,
                "averages": self.averages,
                "partnered": self.partnered,
            }

    return PairwiseAveraging()


def average_all(model: Any) -> int:
    """Every rank's model replaced by the mean of all ranks' (one allreduce over all ranks,
    after training: the model version is this consensus); returns the payload bytes."""
    from training import collective

    return average_with(
        averaged_variables(model), collective.global_process_set(), "pairwise_final"
    )
