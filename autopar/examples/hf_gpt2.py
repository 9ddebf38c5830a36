"""Quickstart with a transformers model: GPT2LMHeadModel with its default config (dropout 0.1, use_cache on)
except its size, trained with autopar on 4 ranks (a 2x2 mesh), no wrapper:

    torchrun --standalone --nproc-per-node 4 -m autopar.examples.hf_gpt2

Each rank prints its step's loss (the global loss: every rank prints the same number). The dropout masks come
from the program's generator, seeded like one device's (`pm.program.manual_seed`), so the losses equal the same
model trained on one device after `torch.manual_seed(0)` (tests/test_newcomer_gpt2_dist.py checks that).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    import autopar
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import GPT2Config, GPT2LMHeadModel

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        # --- the quickstart (README.md) ---
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64))
        model.train()
        ids = torch.randint(0, 128, (8, 64))
        pm = autopar.parallelize(model, mesh, example_kwargs=dict(input_ids=ids, labels=ids))
        pm.program.manual_seed(0)  # the dropout masks one device draws after torch.manual_seed(0)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        for step in range(3):
            opt.zero_grad()
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            print(f"rank {dist.get_rank()} step {step} loss {loss.item():.6f}", flush=True)
        # --- end of the quickstart ---
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
