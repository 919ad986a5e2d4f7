#!/usr/bin/env python3
"""Merges the per-rank Chrome traces that shardline writes (TraceWriter::WriteFile, one per rank,
pid = rank) into one file that Perfetto (https://ui.perfetto.dev) or chrome://tracing opens with
every rank's lanes side by side.

    scripts/merge_traces.py -o all.json trace.json.rank0 trace.json.rank1 ...

examples/train_fsdp merges its ranks' files itself (MergeTraceFiles in runtime/trace.h); this
script is for traces written elsewhere (other hosts, other programs, several runs)."""
import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="per-rank trace files")
    parser.add_argument("-o", "--output", required=True, help="the merged trace")
    args = parser.parse_args()
    events = []
    for path in args.inputs:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            print(f"merge_traces: {path}: {error}", file=sys.stderr)
            return 1
        trace_events = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(trace_events, list):
            print(f"merge_traces: {path}: no traceEvents list", file=sys.stderr)
            return 1
        events.extend(trace_events)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    print(f"merge_traces: {len(events)} events from {len(args.inputs)} files -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
