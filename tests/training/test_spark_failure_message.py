"""The one line of a failed `train --launcher spark`: the rank that failed first is named, not
the one Horovod's Spark runner happened to learn of first.

The runner learns each rank's exit code by polling its task service once a second and names
the first it learned; a rank that only exited because its peer was killed can come first. The
tails below are what `shardflow train fashion-mnist --launcher spark --spark-master local[2]
--np 2 --verbose` printed when rank 0 was SIGKILLed (shortened: the middle of the tracebacks and
Spark's own traceback of the cancelled job), in the runner's two possible orders."""

from __future__ import annotations

import pytest

from training.launcher import _failure_message
from training.spark import FAILURE_PREFIX, rank_exit_line

SPARK = "Horovod's Spark runner"
HOROVOD_SAID = (
    f"{FAILURE_PREFIX}RuntimeError: Horovod detected that one or more processes exited with "
    "non-zero status, thus causing the job to be terminated. The first process to do so was: "
    "Process name: {rank} Exit code: {code}"
)
# Rank 1 after rank 0 was SIGKILLed: Gloo's read fails, TensorFlow's op raises, exit code 1.
PEER_OF_KILLED = [
    "[1]<stderr>:[2026-11-27 10:13:48. 51066: E /tmp/pip-install-qeg1txb9/horovod_5356/horovod/"
    "common/operations.cc:697] [1]: Horovod background loop uncaught exception: [/tmp/pip-install"
    "-qeg1txb9/horovod_5356/third_party/compatible17_gloo/gloo/transport/tcp/pair.cc:589] Read "
    "error [127.0.0.1]:60592: Connection reset by peer",
    "[0]<stderr>:Killed",
    "[1]<stderr>:Traceback (most recent call last):",
    '[1]<stderr>:  File "/work/main/training/collective.py", line 83, in broadcast_variables',
    "[1]<stderr>:    hvd_tf.broadcast_variables(variables, root_rank=root_rank)",
    "[1]<stderr>:tensorflow.python.framework.errors_impl.UnknownError: Graph execution error:",
    "[1]<stderr>:",
    "[1]<stderr>:Detected at node HorovodBroadcast_dense_kernel_v_0 defined at (most recent call "
    "last):",
    "[1]<stderr>:Horovod has been shut down. This was caused by an exception on one of the ranks "
    "or an attempt to allreduce, allgather or broadcast a tensor after one of the ranks finished "
    "execution. If the shutdown was caused by an exception, you should see the exception in the "
    "log before the first shutdown message.",
    "[1]<stderr>:\t [[{{node HorovodBroadcast_dense_kernel_v_0}}]] [Op:__inference_broadcast_gr"
    "oup_397]",
]
SPARK_JOB_CANCELLED = [
    "Exception in thread Thread-4 (run_spark):",
    "Traceback (most recent call last):",
    "py4j.protocol.Py4JJavaError: An error occurred while calling z:org.apache.spark.api.python."
    "PythonRDD.collectAndServe.",
    "\tat java.base/java.lang.Thread.run(Thread.java:840)",
    "",
]


def spark_tail(output: list[str], ends: list[tuple[int, int]]) -> list[str]:
    """The runner's last lines: the ranks' ``output``, each rank's end in the order the runner
    learned them (``ends``: (rank, exit code)), and the runner's error naming the first."""
    first_rank, first_code = ends[0]
    return [
        *output,
        *(rank_exit_line(rank, code) for rank, code in ends),
        *SPARK_JOB_CANCELLED,
        HOROVOD_SAID.format(rank=first_rank, code=first_code),
    ]


@pytest.mark.parametrize("ends", [[(0, 137), (1, 1)], [(1, 1), (0, 137)]])
def test_the_killed_rank_is_named_whichever_end_the_runner_learned_first(
    ends: list[tuple[int, int]],
) -> None:
    message = _failure_message(1, spark_tail(PEER_OF_KILLED, ends), [], SPARK)
    assert message == (
        "training stopped: rank 0 ended with exit code 137 (SIGKILL) and Horovod's Spark "
        "runner stopped the other ranks; rerun with --resume to continue from the last "
        "checkpoint"
    )


def test_a_rank_with_its_own_error_is_named_over_one_stopped_by_sigterm() -> None:
    """Rank 0 failed on its own; rank 1 was then stopped (SIGTERM, as a runner stops the rest),
    and its end was learned first."""
    output = ["[0]<stderr>:Traceback (most recent call last):", "[0]<stderr>:KeyError: 'loss'"]
    message = _failure_message(1, spark_tail(output, [(1, 143), (0, 1)]), [], SPARK)
    assert message.startswith("training stopped: rank 0 ended with exit code 1 (KeyError: 'loss')")


def test_a_rank_stopped_by_sigterm_is_named_over_the_peer_that_lost_it() -> None:
    """Nothing failed on its own: rank 0 was sent SIGTERM (by a user), rank 1 lost its peer."""
    output = [
        line.replace("[0]<stderr>:Killed", "[0]<stderr>:Terminated") for line in PEER_OF_KILLED
    ]
    message = _failure_message(1, spark_tail(output, [(1, 1), (0, 143)]), [], SPARK)
    assert message.startswith("training stopped: rank 0 ended with exit code 143 (SIGTERM) and")


def test_without_every_ranks_end_the_runners_choice_stands() -> None:
    """horovodrun prints no rank's end: its message names the rank it names, as before."""
    tail = [
        *PEER_OF_KILLED,
        "RuntimeError: Horovod detected that one or more processes exited with non-zero status, "
        "thus causing the job to be terminated. The first process to do so was:",
        "Process name: 1",
        "Exit code: 1",
    ]
    message = _failure_message(1, tail, [])
    assert message.startswith(
        "training stopped: rank 1 ended with exit code 1 (tensorflow.python.framework.errors_impl"
        ".UnknownError: Graph execution error:) and horovodrun stopped the other ranks"
    )
