"""The accountant: ε(δ) of a run, budgets, calibration, heterogeneous σ, save/load."""
import os
import tempfile

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip.errors import BudgetExceededError
from adaclip.schedules import LinearNoiseDecay

# Reference values (δ = 1e-5).
rdp = Accountant("rdp")
rdp.step(noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14062)
print(f"RDP: {rdp.epsilon(1e-5):.3f}")        # ≈ 2.597
pld = Accountant("pld")
pld.step(noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14062)
print(f"PLD: {pld.epsilon(1e-5):.3f}")        # ≈ 2.382 (tighter)

# Calibrate σ for a target, then train under a budget that refuses the step that overspends
# (both with PLD, the default; accountant="rdp" would give a σ about 7 % larger).
q, steps = 0.01, 1000
sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=q, steps=steps)
budget = Accountant(target_epsilon=2.0, delta=1e-5)
print(f"sigma = {sigma:.4f}; steps that fit: "
      f"{budget.remaining_steps(noise_multiplier=sigma, sample_rate=q)}")
budget.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
assert budget.would_exceed(noise_multiplier=sigma, sample_rate=q)
try:
    budget.step(noise_multiplier=sigma, sample_rate=q)
except BudgetExceededError:
    print(f"refused; history unchanged: {budget.history}")

# Heterogeneous σ: a noise-decay schedule, one record per step (runs merge automatically).
schedule = LinearNoiseDecay(initial_noise_multiplier=2.0, decay_rate=0.5, steps_per_epoch=100)
decayed = Accountant("rdp")  # RDP composes 300 different σ faster than PLD
for t in range(300):
    decayed.step(noise_multiplier=schedule.at(t).noise_multiplier, sample_rate=q)
print("runs (q, sigma, count):", decayed.history)
print(f"epsilon = {decayed.epsilon(1e-5):.3f}")

# Persist with the checkpoint.
path = os.path.join(tempfile.mkdtemp(), "accountant.json")
decayed.save(path)
assert Accountant.load(path).epsilon(1e-5) == decayed.epsilon(1e-5)
