"""User-level DP in PyTorch: sample users, sum each user's examples into one unit."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip.accounting import Accountant
from adaclip_torch import AdaClip, PoissonUserBatchSampler
from adaclip_torch.data import empty_batch_collate

torch.manual_seed(0)
num_examples, num_users = 600, 100
user_of_example = torch.randint(0, num_users, (num_examples,))
dataset = TensorDataset(torch.randn(num_examples, 20), torch.randint(0, 3, (num_examples,)),
                        user_of_example)

sampler = PoissonUserBatchSampler(user_of_example, sample_rate=0.1,
                                  generator=torch.Generator().manual_seed(1))
# empty_batch_collate turns a step with no sampled user into zero-length tensors
loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=empty_batch_collate(dataset))
model = nn.Linear(20, 3)
accountant = Accountant(target_epsilon=5.0, delta=1e-5)
optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                    noise_multiplier=1.0,
                    expected_batch_size=sampler.expected_batch_size,  # q·U users, not examples
                    accountant=accountant, sample_rate=sampler.sample_rate, seed=0,
                    sampler=sampler)  # user level: every step needs user_ids, and releases the next batch

for x, y, users in loader:
    nn.functional.cross_entropy(model(x), y).backward()   # also runs on an empty batch
    optimizer.step(user_ids=users)
    optimizer.zero_grad()
print(f"{optimizer.steps} steps, user-level epsilon = {accountant.epsilon():.3f}")
