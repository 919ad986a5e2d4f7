"""A Hugging Face GPT-2 (built from a config, random init, nothing downloaded) trained with
shardline's fully_shard on synthetic tokens, with Hugging Face's own gradient checkpointing:

    torchrun --nproc-per-node 2 examples/train_hf.py --save /tmp/gpt2-shardline
    shardline-launch -n 2 -- python examples/train_hf.py
    python examples/train_hf.py --impl single --global-ranks 2    # one process, same batches

fully_shard goes on each transformer block, then on the model, as with FSDP2. Every rank draws
its rows of the same global batch, so --impl single prints the same losses (up to float
rounding). The parameters are this rank's flat slices: the model's size is counted with
shardline.torch.original_shape (model.num_parameters() would count this rank's elements). At the
end --save writes the full weights with model.save_pretrained (every rank calls it; rank 0
writes), reads them back with from_pretrained, and generates a few tokens with both.
"""
import argparse
import math
import os

import torch
import transformers


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["shardline", "single"], default="shardline")
    p.add_argument("--global-ranks", type=int, default=0,
                   help="with --impl single: the rank count whose global batch to train on")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=211)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--checkpointing", choices=["none", "reentrant", "nonreentrant"],
                   default="nonreentrant", help="Hugging Face's gradient checkpointing")
    p.add_argument("--save", default="", help="save_pretrained into this directory at the end")
    args = p.parse_args()
    torch.set_num_threads(1)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.impl == "single":
        rank, world = 0, 1
    ranks = args.global_ranks or world

    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq,
                                     n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=None, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    if args.checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"})
    mean = float
    if args.impl == "shardline":
        import shardline.torch as slt
        for block in model.transformer.h:
            slt.fully_shard(block)
        slt.fully_shard(model)
        world_comm = slt.get_default_world()

        def mean(x):  # the loss averaged over the ranks
            t = torch.tensor([x], dtype=torch.float64)
            world_comm.all_reduce(t).wait()
            return t.item() / world

        count = sum(math.prod(slt.original_shape(q)) for q in model.parameters())
    else:
        count = model.num_parameters()
    if rank == 0:
        print(f"GPT-2, {count} parameters, {world} rank(s), checkpointing {args.checkpointing}")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, args.vocab, (ranks * args.batch, args.seq), generator=g)
        if args.impl == "shardline":
            ids = ids[rank * args.batch:(rank + 1) * args.batch]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = mean(loss.item())
        if rank == 0:
            print(f"step {step} loss {loss:.6f}")

    if args.save:
        model.save_pretrained(args.save)  # every rank: collective; rank 0 writes
        prompt = torch.arange(5).reshape(1, 5)
        tokens = generate(model, prompt)  # the sharded model: every rank takes part
        if rank == 0:
            loaded = transformers.GPT2LMHeadModel.from_pretrained(args.save)
            same = generate(loaded, prompt) == tokens
            print(f"saved to {args.save}; generated {tokens}; "
                  f"from_pretrained generates the same: {same}")


def generate(model, prompt):
    model.eval()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True,
                             attention_mask=torch.ones_like(prompt), pad_token_id=0)
    return out[0].tolist()


if __name__ == "__main__":
    main()
