#!/usr/bin/env python3
"""Draws a merged shardline Chrome trace as a timeline PNG: one lane per (rank, track).

The input is the file examples/train_fsdp --trace writes (runtime/trace.h): "traceEvents" with
"X" spans (pid = rank, tid = track, ts/dur in microseconds), "M" metadata naming processes
("rank 0") and tracks ("compute", "gather", "reduce", "all_reduce", "control") and "C" counters
(the scheduler's bytes in flight). Each span becomes a box coloured by its category (compute,
collective, cast, fill, wait, ...); the x axis is in milliseconds from the window's start.

    .venv/bin/python scripts/plot_timeline.py /tmp/fsdp.json --last-step --out timeline.png
    .venv/bin/python scripts/plot_timeline.py /tmp/fsdp.json --start-ms 40 --end-ms 75 --out t.png

Window: --start-ms/--end-ms are relative to the trace's first span. --step N picks step N
(0-based; negative counts from the end, --last-step is --step -1) by a heuristic: on the first
rank's compute track a step begins at a span named like the trace's first "forward ..." span
("forward embed") that opens the trace or follows a "backward ..." span (so an activation
recomputation inside the backward does not start a step), and ends where the next one begins
(the last step: at the end of the last span that starts inside it). With micro-batches every
micro-batch counts as a step.

Only json and matplotlib are needed.
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# Lane order within a rank; unknown tracks follow, in tid order.
TRACK_ORDER = ["compute", "gather", "reduce", "all_reduce", "control"]

# Category -> (face colour, hatch). Unknown categories get grey.
CATEGORY_STYLE = {
    "compute": ("#4C72B0", None),
    "collective": ("#DD8452", None),
    "cast": ("#55A868", None),
    "reduce": ("#8172B3", None),
    "copy": ("#937860", None),
    "fill": ("#DA8BC3", None),
    "host": ("#8C8C8C", None),
    "wait": ("#FFFFFF", "////"),
}
LEGEND_NAMES = {
    "compute": "compute (framework)",
    "collective": "collective",
    "cast": "cast",
    "reduce": "reduce / accumulate",
    "copy": "copy",
    "fill": "zero fill",
    "host": "host work",
    "wait": "stream waits (for a gather, a reduction...)",
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="merged Chrome trace JSON (train_fsdp --trace)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--start-ms", type=float, help="window start, ms after the first span")
    p.add_argument("--end-ms", type=float, help="window end, ms after the first span")
    p.add_argument("--step", type=int, help="draw step N (0-based, negative from the end)")
    p.add_argument("--last-step", action="store_true", help="draw the last step (--step -1)")
    p.add_argument("--ranks", help="comma-separated ranks to draw (default: all)")
    p.add_argument("--tracks", help="comma-separated tracks to draw (default: all but control)")
    p.add_argument("--title", help="figure title (default: the file name and the window)")
    p.add_argument("--labels", action="store_true",
                   help="write short span names inside the boxes wide enough to hold them: "
                   "F3/B3 = forward/backward of block3, Fembed, AG/RS/AR = all-gather, "
                   "reduce-scatter, all-reduce")
    p.add_argument("--summary", action="store_true",
                   help="print, per rank, the compute track's compute and wait time in the window, "
                   "and each communication track's collective time with how much of it ran "
                   "while the compute track computed")
    p.add_argument("--width", type=float, default=12.0, help="figure width in inches")
    p.add_argument("--dpi", type=int, default=110)
    args = p.parse_args(argv)
    if args.last_step:
        if args.step is not None:
            p.error("--last-step and --step exclude each other")
        args.step = -1
    if args.step is not None and (args.start_ms is not None or args.end_ms is not None):
        p.error("--step/--last-step and --start-ms/--end-ms exclude each other")
    return args


def load(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_timeline: cannot read {path}: {e}")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        sys.exit(f"plot_timeline: {path} has no traceEvents list")
    processes, tracks, spans = {}, {}, []
    for e in events:
        ph = e.get("ph")
        if ph == "M":
            name = e.get("args", {}).get("name", "")
            if e.get("name") == "process_name":
                processes[e["pid"]] = name
            elif e.get("name") == "thread_name":
                tracks[(e["pid"], e["tid"])] = name
        elif ph == "X":
            spans.append(e)
    if not spans:
        sys.exit(f"plot_timeline: {path} has no spans (ph \"X\")")
    spans.sort(key=lambda e: e["ts"])
    return processes, tracks, spans


def step_windows(spans, tracks):
    """(start_us, end_us) of every step, found on the first rank's compute track."""
    first_rank = min(e["pid"] for e in spans)
    compute = [
        e for e in spans
        if e["pid"] == first_rank and tracks.get((e["pid"], e["tid"])) == "compute"
        and e.get("cat") == "compute"
    ]
    forwards = [e.get("name", "") for e in compute if e.get("name", "").startswith("forward")]
    first = forwards[0] if forwards else None
    starts, previous = [], None
    for e in compute:
        name = e.get("name", "")
        # A recomputation ("forward block3" right after "backward block4") is not a step start:
        # only the unit that opens the first step opens a step.
        if name == first and (previous is None or previous.startswith("backward")):
            starts.append(e["ts"])
        previous = name
    if not starts:
        sys.exit("plot_timeline: no step found (no 'forward ...' spans on a compute track); "
                 "use --start-ms/--end-ms")
    windows = []
    for i, start in enumerate(starts):
        if i + 1 < len(starts):
            end = starts[i + 1]
        else:
            end = max(e["ts"] + e.get("dur", 0) for e in spans if e["ts"] >= start)
        windows.append((start, end))
    return windows


def lane_key(pid, tid, tracks):
    name = tracks.get((pid, tid), f"tid {tid}")
    order = TRACK_ORDER.index(name) if name in TRACK_ORDER else len(TRACK_ORDER) + tid
    return (pid, order)


def union_ms(intervals):
    """Total length of the union of (start, end) intervals, and the merged intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged) / 1000.0, merged


def intersection_ms(a, b):
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total / 1000.0


def print_summary(lanes, tracks, processes, lo, hi):
    by_rank = {}
    for (pid, tid), events in lanes.items():
        track = tracks.get((pid, tid), f"tid {tid}")
        for e in events:
            start, end = max(e["ts"], lo), min(e["ts"] + e.get("dur", 0), hi)
            by_rank.setdefault(pid, {}).setdefault((track, e.get("cat", "")), []).append(
                (start, end))
    print(f"window {(hi - lo) / 1000:.2f} ms")
    for pid in sorted(by_rank):
        spans = by_rank[pid]
        compute_ms, compute = union_ms(spans.get(("compute", "compute"), []))
        wait_ms, _ = union_ms(spans.get(("compute", "wait"), []))
        parts = [f"compute {compute_ms:.2f} ms", f"compute waits {wait_ms:.2f} ms"]
        for track in ("gather", "reduce", "all_reduce"):
            busy_ms, busy = union_ms(spans.get((track, "collective"), []))
            if not busy:
                continue
            hidden = intersection_ms(busy, compute)
            parts.append(f"{track} collectives {busy_ms:.2f} ms ({hidden:.2f} ms under compute)")
        print(f"  {processes.get(pid, f'rank {pid}')}: " + ", ".join(parts))


COLLECTIVE_LABELS = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def short_label(name):
    """'forward block3' -> 'F3', 'forward blocks.3' -> 'F3', 'backward embed' -> 'Bembed',
    'all_gather' -> 'AG'."""
    for long, short in (("forward ", "F"), ("backward ", "B")):
        if name.startswith(long):
            unit = name[len(long):]
            for prefix in ("blocks.", "block"):  # torch's "blocks.3", train_fsdp's "block3"
                if unit.startswith(prefix):
                    return short + unit[len(prefix):]
            return short + unit
    return COLLECTIVE_LABELS.get(name, name)


def main(argv):
    args = parse_args(argv)
    processes, tracks, spans = load(args.trace)
    origin = spans[0]["ts"]

    if args.step is not None:
        windows = step_windows(spans, tracks)
        if not -len(windows) <= args.step < len(windows):
            sys.exit(f"plot_timeline: --step {args.step}: the trace has {len(windows)} steps")
        lo, hi = windows[args.step]
        step_no = args.step % len(windows)
        what = f"step {step_no} of {len(windows)}"
    else:
        lo = origin + (args.start_ms or 0.0) * 1000.0
        hi = (origin + args.end_ms * 1000.0 if args.end_ms is not None else
              max(e["ts"] + e.get("dur", 0) for e in spans))
        what = f"{(lo - origin) / 1000:.1f}-{(hi - origin) / 1000:.1f} ms"
    if hi <= lo:
        sys.exit("plot_timeline: the window is empty (end <= start)")

    ranks = {int(r) for r in args.ranks.split(",")} if args.ranks else None
    wanted = set(args.tracks.split(",")) if args.tracks else None
    lanes = {}
    for e in spans:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if end < lo or start > hi:
            continue
        pid, tid = e["pid"], e["tid"]
        track = tracks.get((pid, tid), f"tid {tid}")
        if ranks is not None and pid not in ranks:
            continue
        if (wanted is not None and track not in wanted) or (wanted is None and track == "control"):
            continue
        lanes.setdefault((pid, tid), []).append(e)
    if not lanes:
        sys.exit("plot_timeline: no spans in the window")

    if args.summary:
        print_summary(lanes, tracks, processes, lo, hi)
    order = sorted(lanes, key=lambda k: lane_key(k[0], k[1], tracks))
    height = 0.55 * len(order) + 1.6
    fig, ax = plt.subplots(figsize=(args.width, height))
    span_ms = (hi - lo) / 1000.0
    seen = set()
    for row, (pid, tid) in enumerate(order):
        y = len(order) - 1 - row
        for e in lanes[(pid, tid)]:
            start = (max(e["ts"], lo) - lo) / 1000.0
            end = (min(e["ts"] + e.get("dur", 0), hi) - lo) / 1000.0
            width = max(end - start, span_ms * 0.0008)  # keep instant ops visible
            cat = e.get("cat", "host")
            face, hatch = CATEGORY_STYLE.get(cat, ("#BBBBBB", None))
            seen.add(cat if cat in CATEGORY_STYLE else "other")
            ax.broken_barh([(start, width)], (y - 0.38, 0.76), facecolors=face,
                           edgecolors="#555555" if hatch else face, hatch=hatch, linewidth=0.4)
            label = short_label(e.get("name", "")) if args.labels else ""
            # About 0.33% of the axis per character at this font size.
            if label and cat in ("compute", "collective") and (
                    width > span_ms * (0.0035 * len(label) + 0.003)):
                ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=6,
                        color="white", clip_on=True)
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([
        f"{processes.get(pid, f'rank {pid}')} · {tracks.get((pid, tid), f'tid {tid}')}"
        for pid, tid in reversed(order)
    ], fontsize=8)
    # A faint line between ranks.
    for row in range(1, len(order)):
        if order[row][0] != order[row - 1][0]:
            ax.axhline(len(order) - row - 0.5, color="#999999", linewidth=0.6)
    ax.set_xlim(0, span_ms)
    ax.set_ylim(-0.6, len(order) - 0.4)
    ax.set_xlabel("ms")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    ax.set_title(args.title or f"{args.trace}: {what}", fontsize=10)
    legend = [
        Patch(facecolor=CATEGORY_STYLE[c][0], hatch=CATEGORY_STYLE[c][1], edgecolor="#555555",
              label=LEGEND_NAMES[c]) for c in CATEGORY_STYLE if c in seen
    ]
    if "other" in seen:
        legend.append(Patch(facecolor="#BBBBBB", label="other"))
    # The legend sits in a fixed strip (inches) at the bottom, whatever the number of lanes.
    strip = 0.4 / height
    fig.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=len(legend),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, strip, 1, 1))
    fig.savefig(args.out, dpi=args.dpi)
    print(f"plot_timeline: wrote {args.out} ({what}, {len(order)} lanes, {span_ms:.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
