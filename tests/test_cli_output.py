"""Commands that print tables or JSON end quietly when their reader goes away (``| head -1``):
exit status 141 (128 + SIGPIPE, as ``cat`` and ``git`` end), no traceback."""

import os
import subprocess
import sys

import pytest

PLAN = ["plan", "--model", "gpt-20b", "--gpus", "32", "--gpus-per-node", "4", "--machine", "perlmutter"]


@pytest.mark.parametrize("args", [PLAN, [*PLAN, "--json"], ["plan", "paper"]], ids=["table", "json", "paper"])
def test_a_closed_pipe_ends_the_command_quietly(args):
    read, write = os.pipe()
    os.close(read)               # the reader is gone before the first line: every write fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "par4d.cli", *args], stdout=write, stderr=subprocess.PIPE,
                                text=True, timeout=120)
    finally:
        os.close(write)
    assert result.returncode == 141 and result.stderr == "", result.stderr[-2000:]
