"""One rank of the two-process PrivateTrainer test (started by ``torch.distributed.run``).

Each rank trains the tiny task with the PrivateTrainer, then with the plain data-parallel loop
(make_private with ``distributed=True``), from the same initial model and seed, and saves both
results to ``OUT/rank{r}.pt``. ``torch._dynamo`` is imported before the process group exists
(see ``tests/_gloo.py``)."""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path

import torch

importlib.import_module("torch._dynamo")

sys.path.insert(0, str(Path(__file__).parent))
from _hf_trainer_task import Records, collate, plain_loop, tiny_gpt2, training_arguments  # noqa: E402

from adaclip_torch.trainer import PrivateTrainer  # noqa: E402

PRIVACY = dict(target_epsilon=3.0, delta=1e-3, seed=0, noise_mechanism="banded", bands=2, averaging="ema")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    args = training_arguments(str(out / "trainer"), per_device_train_batch_size=2, ddp_backend="gloo")
    rank, world = args.process_index, args.world_size
    model = tiny_gpt2()
    twin = copy.deepcopy(model)
    trainer = PrivateTrainer(model=model, args=args, train_dataset=Records(48), data_collator=collate, **PRIVACY)
    trainer.train()
    dp = trainer.private_optimizer
    loop = plain_loop(twin, Records(48), training_arguments(str(out / "loop"), per_device_train_batch_size=2), **PRIVACY)
    torch.save(
        {
            "rank": rank, "world": world, "distributed": dp.distributed, "steps": dp.steps,
            "shard": trainer.private_loader.batch_sampler.indices.tolist(),
            "expected_batch_size": dp.expected_batch_size, "epsilon": trainer.epsilon,
            "trainer": [p.detach().clone() for p in model.parameters()],
            "loop": [p.detach().clone() for p in twin.parameters()],
            "trainer_average": dp.average.averaged_parameters(), "loop_average": loop.average.averaged_parameters(),
            "loop_epsilon": loop.get_epsilon(), "initial": [p.detach().clone() for p in tiny_gpt2().parameters()],
        },
        out / f"rank{rank}.pt",
    )  # fmt: skip
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
