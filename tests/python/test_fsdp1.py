"""shardline.torch.FullyShardedDataParallel (FSDP1's wrapper) over a matrix of its constructor
arguments (tests/python/workers/fsdp1_worker.py under shardline.launch, gloo).

Every case trains against the plain model on the global batch in the same process: losses
within 1e-6 relative, every weight of the FULL_STATE_DICT (under the plain model's names)
within 1e-6. Per case also: the units the wrap policy made (one per block, or per Linear of 200+
parameters for the size policy, plus the root) and the wrappers, the printed structure, the
gathers per unit
(activation checkpointing by policy adds none), and the rate limiter: with limit_all_gathers the
scheduler's budget is two units, or the minimum the units need (shard-grad-op and no-shard keep
every unit), and the peak of units in flight stays within it; without, no budget. One case also
runs summon_full_params (writeback and not), FULL_STATE_DICT with rank0_only,
SHARDED_STATE_DICT into a fresh model and the optimizer's state through optim_state_dict /
optim_state_dict_to_load, from flat parameters (use_orig_params=False, the default) into the
original ones and back. One case has floating buffers under MixedPrecision(buffer_dtype=bf16).
"""
import json

import pytest

pytest.importorskip("torch")

CASES = ["base:roundtrip", "shard_grad_op:offload,post", "no_shard:noprefetch,forward",
         "nolimit:orig,roundtrip", "sync:ignored", "size:nosync,clipfn", "lambda:clip",
         "module:ac", "ac:shard_grad_op", "meta:orig", "buffers:post"]


def run(launch, tmp_path, nprocs, cases):
    result = launch(nprocs, ["fsdp1_worker.py", tmp_path, *cases], timeout=150)
    assert result.returncode == 0, result.describe()
    return [json.loads((tmp_path / f"rank{r}.json").read_text())["cases"]
            for r in range(nprocs)]


def check(case, got, rank):
    options = set(case.replace(":", ",").split(","))
    where = (rank, case)
    for a, b in zip(*got["losses"]):
        assert abs(a - b) <= 1e-6 * b, (where, got["losses"])
    assert got["keys"], where
    worst = max(got["weights"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, (where, worst)
    units = 7 if "size" in options else 4
    assert got["units"] == units and got["wrappers"] == units, (where, got)
    assert got["repr"].startswith("FullyShardedDataParallel(\n  (_fsdp_wrapped_module): Net("), \
        got["repr"]
    # use_orig_params=False: the optimizer steps one flat parameter per unit (and the ignored
    # head's two); True: the 24 original ones.
    if "orig" in options:
        assert got["optimizer_params"] == 24 and got["flat_names"] == 0, (where, got)
    else:
        assert got["flat_names"] == units, (where, got)
        assert got["optimizer_params"] == units + (2 if "ignored" in options else 0), (where, got)
    kept = options & {"shard_grad_op", "no_shard", "zero2"}
    assert got["gathers"][1:] == [1 if kept else 2] * (units - 1), (where, got["gathers"])
    if "ac" in options:
        assert got["checkpointed"] == 3, (where, got)
    if "nolimit" in options:
        assert got["budget_units"] == 0, (where, got)
    else:
        assert got["budget_units"] == max(2, got["minimum_budget_units"]), (where, got)
        assert got["peak_inflight_units"] <= got["budget_units"], (where, got)
    if "roundtrip" in options:
        trips = got["round_trips"]
        assert trips["writeback_false"] == 0.0 and trips["full_params_named"], (where, trips)
        assert trips["rank0_only"], (where, trips)
        assert trips["sharded_state_dict"] == 0.0 == trips["optim_state_dict"], (where, trips)
    if "buffers" in options:
        # MixedPrecision(buffer_dtype=bf16): the module's buffers in bf16, the state dicts'
        # in their original float32, as FSDP1's; loading one casts back (values exact in bf16).
        assert got["buffers"] == {"module": ["torch.bfloat16"], "full": ["torch.float32"],
                                  "sharded": ["torch.float32"], "loaded": 0.0,
                                  "names": ["blocks.0.shift", "blocks.1.shift", "blocks.2.shift",
                                            "scale"]}, (where, got["buffers"])


def test_fsdp1_argument_matrix(launch, tmp_path):
    ranks = run(launch, tmp_path, 2, CASES)
    for rank, cases in enumerate(ranks):
        for case in CASES:
            check(case, cases[case], rank)


@pytest.mark.long
def test_fsdp1_hybrid_at_four_ranks(launch, tmp_path):
    cases = ["hybrid:roundtrip", "hybrid2:hybrid,offload,nosync", "base4:clip,ac",
             "zero2:nosync", "pgpair:hybrid,clip", "zero2b:zero2,pgpair,orig"]
    ranks = run(launch, tmp_path, 4, cases)
    for rank, got in enumerate(ranks):
        for case in cases:
            check(case, got[case], rank)
