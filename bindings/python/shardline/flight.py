"""shardline.flight: merge the ranks' flight-recorder dumps and print a diagnosis.

    python -m shardline.flight [-v] [--json] DIR_OR_FILES...
    shardline-flight DIR_OR_FILES...                   # the same, as a console script

Each rank writes its communicators' last collectives as JSON into SHARDLINE_FLIGHT_RECORDER_DIR
when a communicator is aborted (a collective error, a deadline, a peer's abort) and on SIGUSR1.
This reads them and says, in one line per communicator, which rank is behind or where the ranks
diverged. This wraps the tool the C++ tree ships (collectives/tools/shardline-flight), bundled
in the package.
"""

import os
import runpy
import sys

__all__ = ["main"]


def _tool():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_flight_tool.py")


def main(argv=None):
    """Runs the tool with `argv` (default: sys.argv[1:]); returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    tool = runpy.run_path(_tool(), run_name="shardline._flight_tool")
    return tool["main"](argv)


if __name__ == "__main__":
    sys.exit(main())
