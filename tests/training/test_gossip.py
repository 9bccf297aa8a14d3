"""Pairwise averaging (training.gossip): the schedule, and one averaging round on real Horovod
ranks (horovodrun, Gloo, static process sets of two ranks)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from training.gossip import all_pairs, num_rounds, pairing_rounds, partner

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num_ranks", range(1, 10))
def test_every_pair_meets_once_per_cycle_and_no_rank_is_in_two_pairs(num_ranks: int) -> None:
    rounds = pairing_rounds(num_ranks)
    assert len(rounds) == num_rounds(num_ranks)
    met = [pair for pairs in rounds for pair in pairs]
    assert (
        sorted(met)
        == sorted(itertools.combinations(range(num_ranks), 2))
        == list(all_pairs(num_ranks))
    )
    for pairs in rounds:
        ranks = [rank for pair in pairs for rank in pair]
        assert len(ranks) == len(set(ranks))
        # Even N: everyone has a partner; odd N: exactly one rank sits out.
        assert len(ranks) == num_ranks - num_ranks % 2


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 5, 6])
def test_partner_is_symmetric_and_rounds_repeat(num_ranks: int) -> None:
    cycle = num_rounds(num_ranks)
    for index in range(2 * cycle):
        for rank in range(num_ranks):
            other = partner(rank, num_ranks, index)
            assert other != rank
            if other is not None:
                assert partner(other, num_ranks, index) == rank
            assert other == partner(rank, num_ranks, index + cycle)
    sitting_out = [
        [r for r in range(num_ranks) if partner(r, num_ranks, i) is None] for i in range(cycle)
    ]
    # Odd N: every rank sits out exactly once per cycle.
    if num_ranks % 2:
        assert sorted(r for out in sitting_out for r in out) == list(range(num_ranks))
    else:
        assert sitting_out == [[]] * cycle


def test_partner_refuses_a_rank_outside_the_run() -> None:
    with pytest.raises(ValueError, match="rank 3 is not one of 3 ranks"):
        partner(3, 3, 0)


# Each rank: weights of its own (rank-dependent), one averaging round with its partner, then
# the weights and what it handed to Horovod, into OUT/rank-<rank>.json.
_RANK_PROGRAM = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import horovod.tensorflow as hvd
    import tensorflow as tf
    from training import gossip

    num_ranks = int(sys.argv[2])
    sets = gossip.pair_process_sets(num_ranks)
    hvd.init(process_sets=gossip.registered(sets))
    rank = hvd.rank()
    # As in training (the initial broadcast comes first): the process sets are ready once
    # every rank has been through a collective of all ranks.
    hvd.allreduce(tf.constant(0.0), name="ready")
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2),
                                 tf.keras.layers.BatchNormalization()])
    for v in model.variables:
        v.assign(tf.fill(v.shape, float(10 * rank + 1)))
    before = [v.numpy().tolist() for v in model.variables]
    callback = gossip.pairwise_averaging(rank, num_ranks, every=1, process_sets=sets)
    callback.set_model(model)
    callback.on_epoch_begin(0)
    callback.on_train_batch_end(0)
    callback.on_epoch_end(0)
    after = [v.numpy().tolist() for v in model.variables]
    # No rank shuts Horovod down while a pair still averages.
    hvd.allreduce(tf.constant(0.0), name="done")
    with open(f"{sys.argv[1]}/rank-{rank}.json", "w") as f:
        json.dump({"before": before, "after": after, "report": callback.report()}, f)
    """
)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_one_round_leaves_partners_with_the_mean_of_their_weights(
    tmp_path: Path, num_ranks: int
) -> None:
    program = tmp_path / "rank.py"
    program.write_text(_RANK_PROGRAM)
    done = subprocess.run(
        [str(BIN / "horovodrun"), "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
         "--gloo", str(BIN / "python"), str(program), str(tmp_path), str(num_ranks)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(num_ranks)]
    # Every float variable, trainable or not (kernel, bias, BN gamma/beta/moving stats): 5 + 2
    # * 5 = 17 values of 4 bytes.
    weight_bytes = 4 * (3 * 2 + 2 + 4 * 2)
    for rank in range(num_ranks):
        other = partner(rank, num_ranks, 0)
        after = ranks[rank]["after"]
        report = ranks[rank]["report"]
        assert report["averages"] == 1
        if other is None:
            # Sits out round 0 (rank 0 of 3): keeps its own weights, sends nothing.
            assert after == ranks[rank]["before"]
            assert report == {"bytes_by_epoch": [0], "averages": 1, "partnered": 0}
            continue
        assert after == ranks[other]["after"]
        mean = (10 * rank + 1 + 10 * other + 1) / 2
        assert all(value == mean for variable in after for value in _flat(variable))
        assert report == {"bytes_by_epoch": [weight_bytes], "averages": 1, "partnered": 1}


def _flat(nested: object) -> list[float]:
    if isinstance(nested, list):
        return [x for item in nested for x in _flat(item)]
    assert isinstance(nested, float | int)
    return [float(nested)]


def test_pairwise_is_part_of_the_model_identity_and_refuses_gradient_options() -> None:
    from data_catalog.errors import ConfigError
    from training.config import TrainConfig

    pairwise = TrainConfig(model="cnn", sync="pairwise", average_every=4)
    assert pairwise.parameters()["sync"] == "pairwise"
    assert pairwise.parameters()["average_every"] == 4
    assert pairwise.parameters() != TrainConfig(model="cnn").parameters()
    for fields in ({"backward_passes_per_step": 2}, {"compression": "fp16"}):
        with pytest.raises(ConfigError, match="not supported with --sync pairwise"):
            TrainConfig(sync="pairwise", **fields)
    with pytest.raises(ConfigError, match="needs --sync pairwise"):
        TrainConfig(average_every=2)
    with pytest.raises(ConfigError, match="must be one of allreduce, pairwise"):
        TrainConfig(sync="gossip")
    with pytest.raises(ConfigError, match="at least 1"):
        TrainConfig(sync="pairwise", average_every=0)


def test_the_flags_give_the_pairwise_config_back() -> None:
    import argparse

    from flows.options import add_flags, build, command_line
    from training.config import TrainConfig

    config = TrainConfig(model="cnn", sync="pairwise", average_every=3)
    parser = argparse.ArgumentParser()
    add_flags(parser, "train")
    flags = command_line(config, "train")
    assert flags[flags.index("--sync") + 1] == "pairwise"
    assert flags[flags.index("--average-every") + 1] == "3"
    assert build(TrainConfig, parser.parse_args(flags), "train", environ={}) == config
