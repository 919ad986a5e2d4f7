#!/usr/bin/env python3
"""Checkpoint save/load throughput against the disk's own sequential bandwidth, in one run.

    python3 bench/checkpoint/run.py --bench build/bench/checkpoint_bench --dir /var/tmp/slck

Per round, interleaved: dd writes a file of the checkpoint's size (conv=fdatasync), dd drops it
from the page cache (iflag=nocache count=0: posix_fadvise DONTNEED) and reads it back; then one
round of checkpoint_bench (save with fsync, cache dropped, load, every element checked; two
background saves: the time each blocked the caller against one memcpy of the shards; the export
of the full weights to one safetensors file by rank 0, against dd's write; see its header). Medians over the rounds; ratios are checkpoint / dd. Prints a markdown table and, with
--json, writes every sample.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def dd_seconds(args):
    """Runs dd, returns the seconds it reports (its own timing, without process start)."""
    out = subprocess.run(["dd", *args], check=True, capture_output=True, text=True).stderr
    m = re.search(r"copied, ([0-9.e-]+) s", out)
    if not m:
        raise RuntimeError(f"dd said: {out}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", default="build/bench/checkpoint_bench")
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--param-bytes", default="1G")
    ap.add_argument("--states", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write every sample here")
    a = ap.parse_args()

    os.makedirs(a.dir, exist_ok=True)
    samples = []
    for r in range(a.rounds):
        proc = subprocess.run(
            [a.bench, "--dir", a.dir, "--world", str(a.world), "--param-bytes", a.param_bytes,
             "--states", str(a.states), "--rounds", "1"],
            check=True, capture_output=True, text=True, timeout=900)
        ck = json.loads(proc.stdout.strip().splitlines()[-1])
        size = ck["file_bytes"]
        path = os.path.join(a.dir, "dd.bin")
        block = 8 << 20
        count = (size + block - 1) // block
        dd_write = dd_seconds(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
                               "conv=fdatasync"])
        subprocess.run(["dd", f"if={path}", "iflag=nocache", "count=0"], check=True,
                       capture_output=True)
        dd_read = dd_seconds([f"if={path}", "of=/dev/null", f"bs={block}"])
        os.remove(path)
        s = {"round": r, "bytes": size, "dd_bytes": count * block, "dd_write_s": dd_write,
             "dd_read_s": dd_read, **{k: ck[k] for k in ("save_s", "load_s", "memcpy_s")},
             "loadavg": os.getloadavg()[0]}
        for k in ("blocked_s", "blocked_first_s", "snapshot_s", "background_s", "memcpy_fresh_s",
                  "export_s", "export_bytes"):
            s[k] = ck[k]
        samples.append(s)
        print(f"round {r}: save {size / ck['save_s'] / 1e6:.0f} MB/s, dd write "
              f"{s['dd_bytes'] / dd_write / 1e6:.0f} MB/s; load {size / ck['load_s'] / 1e6:.0f} "
              f"MB/s, dd read {s['dd_bytes'] / dd_read / 1e6:.0f} MB/s", file=sys.stderr)

    def med(f):
        return statistics.median(f(s) for s in samples)

    save = med(lambda s: s["bytes"] / s["save_s"])
    load = med(lambda s: s["bytes"] / s["load_s"])
    ddw = med(lambda s: s["dd_bytes"] / s["dd_write_s"])
    ddr = med(lambda s: s["dd_bytes"] / s["dd_read_s"])
    save_ratio = med(lambda s: (s["bytes"] / s["save_s"]) / (s["dd_bytes"] / s["dd_write_s"]))
    load_ratio = med(lambda s: (s["bytes"] / s["load_s"]) / (s["dd_bytes"] / s["dd_read_s"]))
    gib = samples[0]["bytes"] / 2**30
    print(f"\n{a.rounds} rounds, {gib:.2f} GiB checkpoint at world {a.world}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average "
          f"{min(s['loadavg'] for s in samples):.1f}-{max(s['loadavg'] for s in samples):.1f}\n")
    print("| | shardline | dd | ratio (median of per-round ratios) |")
    print("|---|---:|---:|---:|")
    print(f"| write (save, fsync) | {save / 1e6:.0f} MB/s | {ddw / 1e6:.0f} MB/s | "
          f"{save_ratio:.2f} |")
    print(f"| read (load, cache dropped) | {load / 1e6:.0f} MB/s | {ddr / 1e6:.0f} MB/s | "
          f"{load_ratio:.2f} |")
    export = med(lambda s: s["export_bytes"] / s["export_s"])
    export_ratio = med(lambda s: (s["export_bytes"] / s["export_s"])
                       / (s["dd_bytes"] / s["dd_write_s"]))
    print(f"| export (full weights, one writer, fsync) | {export / 1e6:.0f} MB/s | "
          f"{ddw / 1e6:.0f} MB/s | {export_ratio:.2f} |")
    for label, key, ref, ref_label in (
            ("training blocked by a background save (snapshot buffer reused)", "blocked_s",
             "memcpy_s", "memcpy into written memory"),
            ("training blocked by the first background save (new buffer)", "blocked_first_s",
             "memcpy_fresh_s", "memcpy into fresh memory")):
        print(f"| {label} | {med(lambda s: s[key]) * 1e3:.0f} ms | {ref_label} "
              f"{med(lambda s: s[ref]) * 1e3:.0f} ms | {med(lambda s: s[key] / s[ref]):.2f} |")
    print(f"| of which the copy into the reused snapshot buffer | "
          f"{med(lambda s: s['snapshot_s']) * 1e3:.0f} ms | | |")
    print(f"| background write of a save (not blocking) | "
          f"{med(lambda s: s['background_s']) * 1e3:.0f} ms | | |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(samples, f, indent=1)


if __name__ == "__main__":
    main()
