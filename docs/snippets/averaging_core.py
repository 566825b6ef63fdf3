"""The averaging maths on NumPy arrays: an EMA with warm-up and a tail average of the iterates."""
import numpy as np

from adaclip.averaging import AveragingConfig, default_horizon, init_average, update_average

rng = np.random.default_rng(0)
total_steps = 200
H = default_horizon(total_steps)                     # 10 % of the run: 20 steps
ema = AveragingConfig(kind="ema", horizon=H)         # μ = 1 − 1/H = 0.95, with warm-up
tail = AveragingConfig(kind="tail", start=total_steps - H)

theta = np.zeros(5)                                  # θ_0
ema_avg, n_ema = init_average(theta)
tail_avg, n_tail = init_average(theta)
iterates = [theta]
for _ in range(total_steps):
    theta = 1.0 + rng.normal(scale=0.3, size=5)      # a released iterate: optimum 1 plus noise
    iterates.append(theta)
    ema_avg, n_ema = update_average(ema, ema_avg, theta, n_ema)
    tail_avg, n_tail = update_average(tail, tail_avg, theta, n_tail)

assert np.allclose(tail_avg, np.mean(iterates[total_steps - H:], axis=0))
print(f"H = {H}, μ = {ema.effective_decay}")
print("distance to the optimum: last", np.linalg.norm(theta - 1).round(3),
      "| EMA", np.linalg.norm(ema_avg - 1).round(3), "| tail", np.linalg.norm(tail_avg - 1).round(3))
