"""FSDP2 on two CPU processes (gloo): the model is sharded with fully_shard, each rank clips its
own examples over the full parameters, rank 0 alone adds the noise, each rank keeps its shard."""
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
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    try:
        torch.manual_seed(0)                    # identical initial model on every rank
        model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)              # each block first ...
        fully_shard(model)                      # ... then the root: every parameter is sharded
        optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                            noise_multiplier=1.0, expected_batch_size=GLOBAL_BATCH,
                            distributed=True)   # detects the sharded parameters
        assert optimizer.fsdp
        data = torch.Generator().manual_seed(100 + rank)   # each rank its own shard of the data
        for _ in range(3):
            x = torch.randn(GLOBAL_BATCH // WORLD, 20, generator=data)
            y = torch.randint(0, 3, (GLOBAL_BATCH // WORLD,), generator=data)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()                    # collective: every rank must call it
            optimizer.zero_grad()
        if rank == 0:
            shard = model[0].weight.to_local()  # this rank's rows of the first layer
            print(f"3 private steps; rank 0 holds {tuple(shard.shape)} of {tuple(model[0].weight.shape)}")
    finally:
        # DTensor's sharding caches hold the device mesh, hence the process group: clear them
        # so that destroy_process_group() frees it
        _clear_sharding_prop_cache()
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
