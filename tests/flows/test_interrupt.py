"""After Ctrl-C or SIGTERM, what libraries log or raise in their threads while the command
stops them does not reach stderr (the command's one line does); with --debug it does."""

from __future__ import annotations

import subprocess
import sys

import pytest

SNIPPET = """
import logging, sys, threading
import flows.cli as cli
cli._SHOW_TEARDOWN["debug"] = {debug}
try:
    cli._interrupt(2, None)
except KeyboardInterrupt:
    pass
logging.getLogger("tornado.application").error("Exception in callback: loop noise")
def boom():
    raise RuntimeError("thread noise")
thread = threading.Thread(target=boom)
thread.start()
thread.join()
print("stopped")
"""


@pytest.mark.parametrize("debug", [False, True])
def test_teardown_noise_after_an_interrupt(debug: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SNIPPET.format(debug=debug)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stopped\n"
    if debug:
        assert "loop noise" in done.stderr and "thread noise" in done.stderr
    else:
        assert done.stderr == ""
