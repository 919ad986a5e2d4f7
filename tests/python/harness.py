"""Running bounded subprocesses for the tests (conftest.py's `launch` fixture and
test_package.py's launcher tests)."""

import os
import signal
import subprocess
import time

import pytest


class Launched:
    def __init__(self, command, returncode, output, elapsed):
        self.command = command
        self.returncode = returncode
        self.output = output
        self.elapsed = elapsed

    def lines(self, prefix):
        """The output lines (without the launcher's "[rank]<stream>: " tag) that start with
        `prefix`."""
        out = []
        for line in self.output.splitlines():
            if line.startswith("[") and ">: " in line:
                line = line.split(">: ", 1)[1]
            if line.startswith(prefix):
                out.append(line)
        return out

    def describe(self):
        return (f"command: {' '.join(self.command)}\nexit status: {self.returncode} after "
                f"{self.elapsed:.1f} s\n--- output ---\n{self.output}")


def run_bounded(command, *, timeout, env=None):
    """Runs `command` with stdout and stderr together; kills its process group (and so, through
    the launcher's PR_SET_PDEATHSIG, every rank) and fails the test when it outlives `timeout`."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a rank outside the group still holds the pipe
            process.stdout.close()
            output = b"(output lost: the pipe stayed open after the kill)"
        result = Launched(command, None, output.decode(errors="replace"),
                          time.monotonic() - start)
        pytest.fail(f"timed out after {timeout} s\n{result.describe()}")
    return Launched(command, process.returncode, output.decode(errors="replace"),
                    time.monotonic() - start)
