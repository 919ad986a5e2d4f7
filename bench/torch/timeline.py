"""Draws one training step of shardline.torch.fully_shard from a real trace: per rank, the compute
lane (each unit's forward and backward use, and the compute stream's waits for gathers), the
gather stream and the reduce stream.

    PYTHONPATH=build-py/python .venv/bin/python bench/torch/timeline.py \\
        --out docs/img/torch_timeline.png

It runs examples/train_gpt.py --impl shardline on 2 ranks (shardline.launch) with --trace, merges
the ranks' shardline traces with scripts/merge_traces.py and draws the last step with
scripts/plot_timeline.py. Model flags after "--" go to train_gpt.py (default: its headline GPT).
"""
import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(cmd, timeout, env=None):
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, env=env, start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"timeline: {' '.join(map(str, cmd))} failed (exit {proc.returncode})\n"
                         f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "torch_timeline.png"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps run; the last one is drawn")
    p.add_argument("--keep", help="keep the traces in this folder (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("model", nargs="*", help="train_gpt.py flags (after --)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        prefix = folder / "torch_trace"
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("SHARDLINE_TIMEOUT_S", "120")
        out = run([sys.executable, "-m", "shardline.launch", "-n", str(args.ranks), "--grace",
                   "10", "--", sys.executable, str(ROOT / "examples" / "train_gpt.py"),
                   "--impl", "shardline", "--steps", str(args.steps), "--warmup", "1",
                   "--trace", str(prefix), *args.model], args.timeout, env)
        print(out, end="")
        merged = folder / "torch_trace.shardline.json"
        run([sys.executable, str(ROOT / "scripts" / "merge_traces.py"), "-o", str(merged),
             *[str(prefix) + f".shardline.rank{r}.json" for r in range(args.ranks)]], 60)
        print(run([sys.executable, str(ROOT / "scripts" / "plot_timeline.py"), str(merged),
                   "--last-step", "--labels", "--tracks", "compute,gather,reduce", "--out",
                   args.out, "--summary", "--title",
                   f"shardline.torch.fully_shard, examples/train_gpt.py, {args.ranks} ranks: "
                   "one step"], 120), end="")


if __name__ == "__main__":
    main()
