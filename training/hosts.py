"""Before any rank starts on other hosts: can horovodrun reach each one, and does it run this code?

horovodrun itself checks ssh (``_check_all_hosts_ssh_successful``: five tries, then "could not
connect to some hosts via ssh" and a Python traceback), and then starts ``python -m
training.worker`` on every host with this interpreter's path, in this folder; a host without
shardflow there, or with other code, fails later, rank by rank, in the middle of Horovod's
output. :func:`check_hosts` asks each remote host once, in parallel, the way horovodrun will
reach it (``ssh`` from PATH with its options, ``--ssh-port``, ``--ssh-identity-file``):

    ssh HOST 'cd CWD && PYTHON -c "print code version"'
        255            -> cannot reach HOST by ssh (the last line ssh printed)
        other non-zero -> HOST has no shardflow at PYTHON
        a version      -> refused when it is not this command's (the same rule as Dask workers)

Local hosts (names that resolve to an address of this machine, as horovodrun decides with
``network.filter_local_addresses``) are not asked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from data_catalog.errors import ShardflowError
from training.config import LaunchConfig
from training.fingerprint import model_code

# horovodrun's own ssh options (horovod/runner/util/remote.py SSH_COMMAND_PREFIX), plus
# BatchMode so that a missing key fails at once instead of asking for a password.
SSH_OPTIONS = ("-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no",
               "-o", "BatchMode=yes")  # fmt: skip
CONNECT_TIMEOUT_S = 10
ASK_TIMEOUT_S = 120.0
SSH_UNREACHABLE = 255
# What the remote probe prints for its code (data_catalog.identity.source_fingerprint): picked
# out of its output, where a library's warning on stderr may come after it.
FINGERPRINT = re.compile(r"src-[0-9a-f]{16}")


@dataclass(frozen=True)
class HostAnswer:
    host: str
    returncode: int
    output: str


def host_names(config: LaunchConfig, num_ranks: int) -> list[str]:
    """The hosts of ``config`` in order (``--hosts`` or ``--hostfile``), as horovodrun parses
    them; localhost (for ``num_ranks``) when neither is given."""
    from horovod.runner.common.util import hosts

    if config.hostfile:
        try:
            spec = hosts.parse_host_files(config.hostfile)
        except (OSError, IndexError) as exc:
            raise ShardflowError(
                f"cannot read --hostfile {config.hostfile}: {exc}; give one 'HOST slots=N' per line"
            ) from exc
    else:
        spec = config.hosts or f"localhost:{num_ranks}"
    try:
        names, _slots = hosts.parse_hosts_and_slots(spec)
    except (ValueError, IndexError) as exc:
        raise ShardflowError(f"cannot parse hosts {spec!r}: give HOST:SLOTS,...") from exc
    return list(names)


def remote_hosts(config: LaunchConfig, num_ranks: int) -> list[str]:
    """The hosts horovodrun will reach by ssh (those not resolving to this machine)."""
    from horovod.runner.util import network

    return list(network.filter_local_addresses(host_names(config, num_ranks)))


def ssh_command(config: LaunchConfig, host: str, remote: str) -> list[str]:
    """``remote`` (a shell command line) run on ``host`` as horovodrun reaches it."""
    command = ["ssh", *SSH_OPTIONS, "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}"]
    if config.ssh_port is not None:
        command += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file is not None:
        command += ["-i", config.ssh_identity_file]
    return [*command, host, remote]


def _ask(config: LaunchConfig, host: str, remote: str) -> HostAnswer:
    try:
        done = subprocess.run(
            ssh_command(config, host, remote),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=ASK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return HostAnswer(host, SSH_UNREACHABLE, f"no answer within {ASK_TIMEOUT_S:.0f} s")
    except FileNotFoundError as exc:
        raise ShardflowError("no `ssh` on PATH: horovodrun needs it to start remote ranks") from exc
    return HostAnswer(host, done.returncode, (done.stdout + done.stderr).strip())


def check_hosts(config: LaunchConfig, num_ranks: int) -> list[str]:
    """Refuse, in one line, a remote host that ssh cannot reach, that has no shardflow at this
    interpreter's path, or that runs other code; returns the remote hosts checked."""
    remote = remote_hosts(config, num_ranks)
    if not remote:
        return []
    mine = model_code()
    probe = f"cd {shlex.quote(os.getcwd())} && {shlex.quote(sys.executable)} -c " + shlex.quote(
        "from training.fingerprint import model_code; print(model_code())"
    )
    with ThreadPoolExecutor(max_workers=min(16, len(remote))) as pool:
        answers = list(pool.map(lambda host: _ask(config, host, probe), remote))
    for answer in answers:
        lines = answer.output.splitlines()
        last = lines[-1] if lines else "no output"
        stripped = (line.strip() for line in reversed(lines))
        code = next((line for line in stripped if FINGERPRINT.fullmatch(line)), last)
        if answer.returncode == SSH_UNREACHABLE:
            port = config.ssh_port or 22
            raise ShardflowError(
                f"cannot reach host {answer.host} by ssh (port {port}): {last}; check --hosts, "
                "--ssh-port and --ssh-identity-file (nothing was started)"
            )
        if answer.returncode != 0:
            raise ShardflowError(
                f"host {answer.host} has no shardflow at {sys.executable} in {os.getcwd()} "
                f"({last}): horovodrun starts every rank with that interpreter in that folder; "
                "install the same code there (nothing was started)"
            )
        if code != mine:
            raise ShardflowError(
                f"host {answer.host} runs other training code ({code}) than this command "
                f"({mine}): install the same code on every host (nothing was started)"
            )
    return remote
