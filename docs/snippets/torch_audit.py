"""Audit a PyTorch training run: white-box gradient canaries and a loss-threshold attack."""
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.audit import loss_threshold_attack
from adaclip_torch import AdaClip, poisson_data_loader
from adaclip_torch.audit import GradientCanaryAuditor, per_example_losses

torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32)
y = torch.tensor(y)
members, held_out = slice(0, 1200), slice(1200, None)      # train on 1200, keep 597 out
train = TensorDataset(x[members], y[members])

N, epochs, q = 1200, 10, 100 / 1200
steps = epochs * round(1 / q)
sigma = calibrate_noise_multiplier(target_epsilon=3.0, delta=1e-5, sample_rate=q, steps=steps)
accountant = Accountant("pld")

model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), model,
                    noise_multiplier=sigma, expected_batch_size=q * N, initial_max_grad_norm=1.0,
                    accountant=accountant, sample_rate=q, seed=0)
# m canaries, each in the run with probability 1/2, each sampled like any other unit (rate q)
auditor = GradientCanaryAuditor(optimizer, num_canaries=1000, seed=1)

loader = poisson_data_loader(train, q, num_steps=round(1 / q), generator=torch.Generator().manual_seed(2))
for _ in range(epochs):
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        auditor.step()            # instead of optimizer.step()
        optimizer.zero_grad()

report = auditor.report(delta=1e-5)
print(report)                     # ε_emp ≥ … (one-run, 95 %); GDP fit …; accountant ε = …
assert report.epsilon_lower <= report.accountant_epsilon

# Black box: do the training examples have lower loss than examples never trained on?
mia = loss_threshold_attack(per_example_losses(model, x[members], y[members]),
                            per_example_losses(model, x[held_out], y[held_out]))
print(mia)
accuracy = (model(x[held_out]).argmax(1) == y[held_out]).float().mean().item()
print(f"held-out accuracy {accuracy:.3f}")
