"""Secrets reach the ranks through a file of the run folder, never a command line (issue #29,
"Must show"; tests/cluster/test_run_s3_hosts.py watches a real run across hosts)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from training import credentials


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("AWS_SECRET_ACCESS_KEY", True),
        ("AWS_SESSION_TOKEN", True),
        ("MY_SERVICE_PASSWORD", True),
        ("HF_TOKEN", True),
        ("AWS_ACCESS_KEY_ID", False),
        ("AWS_ENDPOINT_URL", False),
        ("HOROVOD_SECRET_KEY", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("SHARDFLOW_RANK_CREDENTIALS", False),
    ],
)
def test_which_variables_are_secrets(name: str, secret: bool) -> None:
    assert credentials.is_secret(name) is secret


def test_the_file_only_this_user_reads_lives_as_long_as_the_ranks(tmp_path: Path) -> None:
    environ = {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_ACCESS_KEY_ID": "id", "PATH": "/bin"}
    with credentials.credentials_file(tmp_path, environ) as added:
        path = Path(added[credentials.FILE_VARIABLE])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        rank: dict[str, str] = {credentials.FILE_VARIABLE: str(path)}
        credentials.load(rank)
        assert rank["AWS_SECRET_ACCESS_KEY"] == "s3cr3t" and "AWS_ACCESS_KEY_ID" not in rank
    assert not path.exists()
    with credentials.credentials_file(tmp_path, {"PATH": "/bin"}) as added:
        assert added == {} and not (tmp_path / credentials.FILE_NAME).exists()


def test_a_rank_that_cannot_read_the_file_says_why(tmp_path: Path) -> None:
    from data_catalog.errors import ShardflowError

    missing = {credentials.FILE_VARIABLE: str(tmp_path / "elsewhere.json")}
    with pytest.raises(ShardflowError, match="must be on storage every host shares"):
        credentials.load(missing)


def test_horovodrun_spells_no_secret_on_a_ranks_command_line() -> None:
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.gloo_run import _slot_info_to_command_fn

    credentials.withhold_from_command_lines()
    env = {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_ENDPOINT_URL": "http://store:9000"}
    command = _slot_info_to_command_fn("python -m training.worker x.json", env)(
        SlotInfo(hostname="w1", rank=0, local_rank=0, cross_rank=0, size=2, local_size=1,
                 cross_size=2)
    )  # fmt: skip
    assert "s3cr3t" not in command and "AWS_SECRET_ACCESS_KEY" not in command
    assert "AWS_ENDPOINT_URL=http://store:9000" in command
