"""Data parallel on two CPU processes (gloo): each rank clips its own examples, the clipped
sums are all-reduced, rank 0 alone adds the noise. Do not also wrap the model in DDP."""
import importlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from adaclip_torch import AdaClip

WORLD = 2
GLOBAL_BATCH = 64          # expected batch size over all ranks


def worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # before init_process_group: destroy then frees the group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)                    # identical initial model on every rank
        model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                            noise_multiplier=1.0, expected_batch_size=GLOBAL_BATCH,
                            distributed=True)
        data = torch.Generator().manual_seed(100 + rank)   # each rank its own shard
        for _ in range(3):
            x = torch.randn(GLOBAL_BATCH // WORLD, 20, generator=data)
            y = torch.randint(0, 3, (GLOBAL_BATCH // WORLD,), generator=data)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()                    # collective: every rank must call it
            optimizer.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.zeros_like(flat) for _ in range(WORLD)]
        dist.all_gather(gathered, flat)
        if rank == 0:
            assert all(torch.equal(gathered[0], g) for g in gathered)
            print("both ranks hold identical parameters after 3 private steps")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
