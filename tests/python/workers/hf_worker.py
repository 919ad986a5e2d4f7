"""One rank of Hugging Face models trained three ways, run by test_hf.py under shardline.launch:
shardline's fully_shard, torch's FSDP2 (gloo), and one process on the global batch.

    hf_worker.py OUT_DIR CASE [CASE ...]

CASE is MODEL:DTYPE:CHECKPOINTING[:EXTRA,...]
    MODEL          gpt2 | llama | bert (small configs, random init, nothing downloaded; no dropout,
                   so every run draws the same numbers)
    DTYPE          fp32 | bf16 (MixedPrecisionPolicy(param_dtype=bfloat16), reductions in fp32)
    CHECKPOINTING  none | reentrant | nonreentrant (HF's gradient_checkpointing_enable)
    EXTRA          accum (two micro-batches a step), nosync (the same, the first micro-batch
                   without gradient sync: set_requires_gradient_sync(False)), clip
                   (clip_grad_norm_ at 0.5), eval (an eval loss after training), generate
                   (greedy tokens from the trained sharded model under no_grad, and from an
                   unsharded model holding its full weights), output_dtype
                   (MixedPrecisionPolicy(output_dtype=bfloat16) on the root: the output keeps
                   its ModelOutput type), save_pretrained (the trained sharded model's
                   save_pretrained, then from_pretrained of that directory on every rank: equal
                   to the full state dict bit for bit; and the parameter count that
                   shardline.torch.original_shape gives equals the unsharded model's), fsdp1
                   (shardline's FullyShardedDataParallel with transformer_auto_wrap_policy on
                   the block class in place of fully_shard)

fully_shard is applied the FSDP2 way: each transformer block, then the root. Each rank trains on
its rows of the global batch; the reference trains on all of them. Every rank writes
OUT_DIR/rank<r>.json: per case the three runs' losses, and per parameter of the full state dict
the largest absolute difference from FSDP2's and the relative error against the reference.
"""
import functools
import json
import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardline.torch as slt

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 97, 11, 4, 3


def make_model(kind):
    """A small randomly initialised model and its list of transformer blocks."""
    import transformers as hf

    torch.manual_seed(1234)
    if kind == "gpt2":
        config = hf.GPT2Config(n_embd=48, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=32,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = hf.GPT2LMHeadModel(config)
        blocks = model.transformer.h
    elif kind == "llama":
        config = hf.LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                max_position_embeddings=32)
        model = hf.LlamaForCausalLM(config)
        blocks = model.model.layers
    elif kind == "bert":
        config = hf.BertConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                               num_attention_heads=4, vocab_size=VOCAB,
                               max_position_embeddings=32, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        model = hf.BertForMaskedLM(config)
        blocks = model.bert.encoder.layer
    else:
        raise SystemExit(f"unknown model {kind}")
    # HF starts biases at zero; random ones keep the tensors whose exact gradient is zero (an
    # attention key's bias) away from zero, so that a relative error against the reference
    # measures the training, not rounding noise.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    model.config.use_cache = False
    return model, blocks


def batches(step, micro):
    """The global batch of a step, as `micro` micro-batches of token ids."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH * micro, SEQ), generator=g)
    return ids.chunk(micro)


def rows(ids, rank, size):
    per = ids.shape[0] // size
    return ids[rank * per:(rank + 1) * per]


def train(kind, dtype, ckpt, extras, way, rank, size):
    """Trains one way ('shardline', 'fsdp2' or 'reference'); returns (model, losses, eval)."""
    model, blocks = make_model(kind)
    model.train()
    if ckpt != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
    bf16 = dtype == "bf16"
    if way == "shardline" and "fsdp1" in extras:
        # FSDP1's way: the wrapper with transformer_auto_wrap_policy on the model's block class
        policy = functools.partial(slt.transformer_auto_wrap_policy,
                                   transformer_layer_cls={type(blocks[0])})
        mp = slt.MixedPrecision(param_dtype=torch.bfloat16 if bf16 else None,
                                reduce_dtype=torch.float32 if bf16 else None)
        model = slt.FullyShardedDataParallel(model, auto_wrap_policy=policy, mixed_precision=mp)
    elif way == "shardline":
        mp = slt.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                      reduce_dtype=torch.float32 if bf16 else None)
        root_mp = mp
        if "output_dtype" in extras:
            root_mp = slt.MixedPrecisionPolicy(param_dtype=mp.param_dtype,
                                               reduce_dtype=mp.reduce_dtype,
                                               output_dtype=torch.bfloat16)
        for block in blocks:
            slt.fully_shard(block, mp_policy=mp)
        slt.fully_shard(model, mp_policy=root_mp)
    elif way == "fsdp2":
        mp = TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                       reduce_dtype=torch.float32 if bf16 else None)
        root_mp = mp
        if "output_dtype" in extras:
            root_mp = TorchMixedPrecisionPolicy(param_dtype=mp.param_dtype,
                                                reduce_dtype=mp.reduce_dtype,
                                                output_dtype=torch.bfloat16)
        for block in blocks:
            torch_fully_shard(block, mp_policy=mp)
        torch_fully_shard(model, mp_policy=root_mp)
    elif bf16:
        model = model.to(torch.bfloat16)  # the one-process reference of bf16 is not compared
    micro = 2 if extras & {"accum", "nosync"} else 1
    # SGD with momentum: AdamW would blow the rounding noise in gradients that are zero in exact
    # arithmetic (attention key biases) up to the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m, ids in enumerate(batches(step, micro)):
            if way != "reference":
                ids = rows(ids, rank, size)
                model.set_requires_gradient_sync("nosync" not in extras or m == micro - 1)
            out = model(input_ids=ids, labels=ids)
            if "output_dtype" in extras and way != "reference":
                if type(out).__name__ == "dict" or out.logits.dtype != torch.bfloat16:
                    raise AssertionError(f"output_dtype: got {type(out).__name__} with logits "
                                         f"{getattr(out, 'logits', None)!r:.40}")
            (out.loss.float() / micro).backward()
            total += out.loss.item() / micro
        if "clip" in extras:
            clip = slt.clip_grad_norm_ if way == "shardline" else torch.nn.utils.clip_grad_norm_
            clip(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        if way != "reference":
            # The rank's loss is its rows' mean; the global loss is the mean over the ranks.
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            total = t.item() / size
        losses.append(total)
    evaluation = None
    if "eval" in extras:
        model.eval()
        with torch.no_grad():
            ids = batches(STEPS, 1)[0]
            if way != "reference":
                ids = rows(ids, rank, size)
            loss = model(input_ids=ids, labels=ids).loss.double()
            if way != "reference":
                dist.all_reduce(loss)
                loss /= size
            evaluation = loss.item()
        model.train()
    return model, losses, evaluation


def full_weights(model, way):
    if isinstance(model, slt.FullyShardedDataParallel):
        return model.state_dict()  # FULL_STATE_DICT, FSDP1's default
    if way == "shardline":
        return slt.full_state_dict(model)
    if way == "fsdp2":
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach() for k, v in model.state_dict().items()}


def generate(kind, dtype, model, weights):
    """Greedy tokens of the trained sharded model and of an unsharded copy of its weights (in
    the dtype the sharded model computes in)."""
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    plain, _ = make_model(kind)
    plain.load_state_dict(weights)
    if dtype == "bf16":
        plain = plain.to(torch.bfloat16)
    out = {}
    for name, m in (("sharded", model), ("unsharded", plain)):
        m.eval()
        with torch.no_grad():
            tokens = m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True,
                                pad_token_id=0, attention_mask=torch.ones_like(prompt))
        out[name] = tokens.tolist()
    return out


def save_pretrained(kind, model, weights, directory):
    """The sharded model's save_pretrained, read back by from_pretrained."""
    model.save_pretrained(directory)
    dist.barrier()
    plain, _ = make_model(kind)
    loaded = type(plain).from_pretrained(directory)
    got = loaded.state_dict()
    count = sum(math.prod(slt.original_shape(p)) for p in model.parameters())
    return {"keys_equal": sorted(got) == sorted(weights),
            "max_abs": max((got[k].float() - w).abs().max().item() for k, w in weights.items()),
            "parameters": [count, plain.num_parameters()]}


def run_case(case, rank, size, directory):
    kind, dtype, ckpt, *rest = case.split(":")
    extras = set(rest[0].split(",")) if rest and rest[0] else set()
    result = {"losses": {}, "eval": {}, "vs_fsdp2": {}, "vs_reference": {}}
    weights = {}
    for way in ("shardline", "fsdp2", "reference"):
        if way == "reference" and dtype == "bf16":
            continue  # bf16 is compared with FSDP2 only (bitwise)
        model, losses, evaluation = train(kind, dtype, ckpt, extras, way, rank, size)
        result["losses"][way] = losses
        result["eval"][way] = evaluation
        weights[way] = {k: v.float() for k, v in full_weights(model, way).items()}
        if way == "shardline":
            result["keys"] = sorted(weights[way])
            if "generate" in extras:
                result["generate"] = generate(kind, dtype, model, weights[way])
            if "save_pretrained" in extras:
                result["save_pretrained"] = save_pretrained(kind, model, weights[way], directory)
    result["fsdp2_keys"] = sorted(weights["fsdp2"])
    for name, w in weights["shardline"].items():
        result["vs_fsdp2"][name] = (w - weights["fsdp2"][name]).abs().max().item()
        if "reference" in weights:
            ref = weights["reference"][name]
            result["vs_reference"][name] = ((w - ref).norm() / ref.norm()).item()
    return result


def main():
    out_dir, cases = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {case: run_case(case, rank, size, os.path.join(out_dir, f"pretrained{i}"))
               for i, case in enumerate(cases)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "cases": results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
