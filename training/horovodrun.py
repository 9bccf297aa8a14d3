"""horovodrun as the launcher runs it: ``python -m training.horovodrun --parent PID ARGS...``
is ``horovodrun ARGS...`` with three changes, all for things Horovod 0.28.1 offers no option for.

- **It dies with its parent.** horovodrun keeps running, and its ranks keep training, when the
  process that started it is killed (SIGKILL leaves no chance to stop it). Here it asks Linux
  for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``); horovodrun's own SIGTERM handler
  (``gloo_run.register_shutdown_event``) then has each rank's middleman stop its rank
  (``safe_shell_exec.terminate_executor_shell_and_children``: SIGTERM, SIGKILL after 5 s).
  A SIGTERM its starter ignored or blocked is taken back first (both are inherited, and an
  ignored one made the death signal a no-op while the ranks started). And because that chain
  of signal, handler, thread event and inter-process event once left horovodrun and both ranks
  running after its parent was SIGKILLed (twice, in full test runs under load, cause not
  found), a thread watches the parent without signals: once it is gone and horovodrun has not
  stopped its ranks within ``STOP_GRACE_SECONDS``, it SIGKILLs the ranks' process groups (each
  middleman leads a session holding its shell and rank) and then itself.
- **Its Gloo rendezvous server listens only where the ranks reach it.** horovodrun binds it to
  every interface (``util/network.py`` ``find_port`` binds ``('', port)``), even for
  ``-H localhost:N``. Here it binds the address horovodrun gives the ranks
  (``HOROVOD_GLOO_RENDEZVOUS_ADDR``, ``network.get_driver_ip`` of the chosen interfaces):
  127.0.0.1 when every host is local, the chosen interface's address otherwise.
- **No secret on a command line.** horovodrun spells its whole environment on each rank's
  command line (``env K=V ... python``, through ssh for a remote host), where any user of
  either host can read it; the variables that hold secrets are left out
  (:mod:`training.credentials`: the ranks read them from a file of the run folder).

What else listens during a run, and why it is left as it is: docs/training.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

USAGE = "usage: python -m training.horovodrun --parent PID HOROVODRUN_ARGS..."
# horovodrun's own stop takes up to ~10 s: SIGTERM, 5 s, SIGKILL of each rank, then 5 s for
# its shell (safe_shell_exec.GRACEFUL_TERMINATION_TIME_S twice).
STOP_GRACE_SECONDS = 15.0
WATCH_SECONDS = 1.0


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when its parent dies, even by SIGKILL (Linux only).

    flows/prefect_server.py has a ``preexec_fn`` twin; this one runs after exec, in the child's
    own interpreter, because ``preexec_fn`` is unsafe in a parent with threads (a Prefect flow
    run has many) and training must not import flows. It also closes the window before the
    request took effect: a parent already gone is noticed by the changed parent pid.
    """
    import ctypes

    # A starter's ignored or blocked SIGTERM is inherited; neither may swallow the death signal.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def stop_ranks_when_parent_dies(parent_pid: int) -> threading.Thread:
    """Watch, without signals, for the parent's death; then give horovodrun's own stop
    ``STOP_GRACE_SECONDS`` and, if it is still running, SIGKILL every process group its
    children lead (a middleman, its shell, its rank) and this process."""

    def watch() -> None:
        groups: set[int] = set()
        while os.getppid() == parent_pid:
            groups |= _child_groups()
            time.sleep(WATCH_SECONDS)
        # The death signal may have been lost: ask for horovodrun's own stop once more.
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline:
            groups |= _child_groups()
            time.sleep(WATCH_SECONDS)
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="stop-ranks-when-parent-dies", daemon=True)
    thread.start()
    return thread


def _child_groups() -> set[int]:
    """The process groups this process's children lead (safe_shell_exec's middlemen call
    ``os.setsid``); a child still in this process's group is not one."""
    import psutil

    own = os.getpgid(0)
    groups = set()
    for child in psutil.Process().children():
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            group = os.getpgid(child.pid)
            if group == child.pid and group != own:
                groups.add(group)
    return groups


def bind_rendezvous_to_driver_address() -> None:
    """Make horovodrun's Gloo rendezvous server bind the address the ranks are told to use.

    ``gloo_run.launch_gloo`` receives that address (``server_ip``) and starts
    ``http_server.RendezvousServer``, whose ``start`` finds a free port with ``find_port``
    on ``('', port)``; for the duration of ``launch_gloo``, ``find_port`` gets the address.
    """
    from horovod.runner import gloo_run
    from horovod.runner.http import http_server

    launch_gloo: Callable[..., Any] = gloo_run.launch_gloo
    find_port: Callable[..., Any] = http_server.find_port

    def launch_gloo_bound(
        command: Any, exec_command: Any, settings: Any, nics: Any, env: Any, server_ip: str
    ) -> Any:
        def find_port_on_server_ip(server_factory: Callable[[tuple[str, int]], Any]) -> Any:
            return find_port(lambda address: server_factory((server_ip, address[1])))

        http_server.find_port = find_port_on_server_ip
        try:
            return launch_gloo(command, exec_command, settings, nics, env, server_ip)
        finally:
            http_server.find_port = find_port

    gloo_run.launch_gloo = launch_gloo_bound


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--parent" or not args[1].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    # First, before the slow imports: the parent may be killed while they run.
    die_with_parent(int(args[1]))
    stop_ranks_when_parent_dies(int(args[1]))
    bind_rendezvous_to_driver_address()
    from training.credentials import withhold_from_command_lines

    withhold_from_command_lines()
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *args[2:]]
    run_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
