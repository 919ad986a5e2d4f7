"""shardline.launch: start N local processes with a torchrun-style environment.

    python -m shardline.launch -n 4 [--tag-output] [--grace 30] [--] program [args...]
    shardline-launch -n 4 -- python train.py          # the same, as a console script
    shardline-launch -n 4 --nnodes 2 --node-rank K --master-addr HOST0 --master-port 29500 -- ...

Every process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
which shardline.init() reads, and SHARDLINE_STORE_TOKEN (the environment's, else a random one per
job; with nnodes > 1 it must come from the environment, the same on every machine). Across
machines, one launcher per machine (--nnodes, --node-rank, the same --master-addr/--master-port:
docs/collectives.md, "shardline-launch"). A failing process stops the others after a grace
period; the launcher exits with the first failure's code. This wraps the launcher the C++ tree ships
(collectives/tools/shardline-launch), bundled in the package.
"""

import os
import subprocess
import sys

__all__ = ["main", "run"]


def _tool():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch_tool.py")


def run(nprocs, args, *, tag_output=False, grace=None, env=None, timeout=None, nnodes=None,
        node_rank=None, master_addr=None, master_port=None):
    """Runs `args` (a list: program and arguments) as `nprocs` ranks; returns the exit code.

    timeout: seconds before the launcher is interrupted (SIGTERM reaches every rank); None waits.
    nnodes, node_rank, master_addr, master_port: this machine's part of a job across `nnodes`
    machines (ranks node_rank * nprocs ...), as the launcher's flags of the same names.
    """
    command = [sys.executable, _tool(), "-n", str(int(nprocs))]
    if tag_output:
        command.append("--tag-output")
    if grace is not None:
        command += ["--grace", str(grace)]
    for flag, value in (("--nnodes", nnodes), ("--node-rank", node_rank),
                        ("--master-addr", master_addr), ("--master-port", master_port)):
        if value is not None:
            command += [flag, str(value)]
    command += ["--", *args]
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, _tool(), *argv])


if __name__ == "__main__":
    main()
