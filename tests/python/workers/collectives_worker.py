"""One rank of test_collectives.py: joins the launcher's world with shardline.init() and runs
every case of collective_cases.py. Exits 1 with a message naming the case on any mismatch or
error; prints "COLLECTIVES OK rank R" when everything matched.

    python -m shardline.launch -n 4 -- python collectives_worker.py numpy,torch
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shardline  # noqa: E402
from collective_cases import run_all  # noqa: E402


def main():
    frameworks = sys.argv[1].split(",") if len(sys.argv) > 1 else ["numpy"]
    world = shardline.init(timeout=60.0)
    rank = world.rank
    if world.size != int(os.environ["WORLD_SIZE"]) or rank != int(os.environ["RANK"]):
        print(f"rank {rank}: init() gave rank {rank} of {world.size}, the launcher said "
              f"{os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
        return 1
    try:
        run_all(world, frameworks, log=lambda m: print(m, flush=True))
    except Exception:  # noqa: BLE001 - report it, whatever it is
        print(f"rank {rank}: FAILED\n{traceback.format_exc()}", flush=True)
        world.abort()  # the peers fail at once instead of waiting for their deadlines
        return 1
    print(f"COLLECTIVES OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
