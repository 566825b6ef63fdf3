"""One-run white-box canary audit of BLT noise: a correct run and one releasing σ/2, whitened and raw.

The configuration of ``tests/test_torch_audit_blt.py``: FlatClip at learning rate 0 on a
``Linear(50, 40)`` (d = 2,000), N = 64 examples in fixed-order batches of B = 16 (b = 4), T = 80
steps, the factor ``fit_blt(T, buffers=2, min_separation=b)`` and the σ that
``calibrate_block_noise_multiplier`` gives for ε = 4 at δ = 1e-5 (RDP), a PLD accountant,
m = 1000 canaries. For each run it prints the auditor's report (the whitened, normalised matched
filter ``⟨C r, C s_g⟩/‖C s_g‖``) and, for comparison, the report of the raw matched filter on the
same read-backs (``⟨r, s_g⟩/‖s_g‖``: no whitening), plus the GDP μ the whitening predicts.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/audit/blt_canaries.py [--seeds 0 1]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

import adaclip_torch
from adaclip import accounting
from adaclip.accounting import Accountant
from adaclip.audit.report import audit_scores
from adaclip.correlated.blt import fit_blt
from adaclip_torch.audit import GradientCanaryAuditor
from adaclip_torch.data import FixedOrderBatchSampler

DELTA, N, BATCH, STEPS, M, EPSILON, IN, OUT = 1e-5, 64, 16, 80, 1000, 4.0, 50, 40


def run(seed: int, noise_scale: float) -> dict[str, object]:
    """One audited run; ``noise_scale`` multiplies the released correlated noise (σ accounted)."""
    b = -(-N // BATCH)
    noise = fit_blt(STEPS, buffers=2, min_separation=b)
    prefix = accounting.MinSeparationParticipation(b).prefix_sensitivities_squared(noise.column(STEPS))
    sigma = accounting.calibrate_block_noise_multiplier(target_epsilon=EPSILON, delta=DELTA, prefix=prefix, block=b,
                                                        accountant="rdp")  # fmt: skip
    torch.manual_seed(seed)
    model = nn.Linear(IN, OUT, bias=False)
    x, y = torch.randn(N, IN), torch.randint(0, OUT, (N,))
    sampler = FixedOrderBatchSampler(N, BATCH, generator=torch.Generator().manual_seed(seed), total_steps=STEPS)
    opt = adaclip_torch.FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0,
                                 noise_multiplier=sigma, expected_batch_size=BATCH, loss_reduction="sum",
                                 accountant=Accountant("pld"), sample_rate=BATCH / N, seed=seed,
                                 noise_mechanism=noise, sampler=sampler)  # fmt: skip
    if noise_scale != 1.0:
        correlate = opt._stream.correlate  # the test-only hook of the audit tests
        opt._stream.correlate = lambda z: [noise_scale * v for v in correlate(z)]
    auditor = GradientCanaryAuditor(opt, num_canaries=M, seed=seed)
    canaries, reads = auditor.canaries, []
    observe = canaries.observe

    def logged(released, centre, scale, *, expected_batch_size, **kw):
        j = canaries.coordinates
        reads.append((released[j] - centre[j]) * expected_batch_size / scale[j])
        observe(released, centre, scale, expected_batch_size=expected_batch_size, **kw)

    canaries.observe = logged
    for _ in range(STEPS):
        idx = sampler.batch(sampler.position)
        sampler.position += 1
        nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum").backward()
        auditor.step()
        opt.zero_grad()
    slots = np.array([[t % b == g for g in canaries.groups] for t in range(STEPS)], dtype=float)
    raw = (np.array(reads) * slots).sum(0) / np.linalg.norm(slots, axis=0)
    acc_eps = opt.accountant.epsilon(DELTA)
    big_c = sum(np.diag(np.full(STEPS - k, c), -k) for k, c in enumerate(noise.column(STEPS)))
    norms = np.linalg.norm(big_c @ slots, axis=0)
    return {
        "sigma": sigma,
        "predicted_mu": float(np.mean(norms[canaries.included])) / (noise_scale * sigma if noise_scale else 1.0),
        "accountant_mu": float(np.sqrt(prefix[-1])) / sigma,
        "whitened": auditor.report(delta=DELTA),
        "raw": audit_scores(raw, canaries.included, delta=DELTA, accountant_epsilon=acc_eps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | seed | σ | accountant μ | predicted μ | score | ε_emp (one-run) | GDP μ̂ ± se | s₀/σ | GDP ε [90 %] | accountant ε |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for name, scale in (("correct", 1.0), ("σ/2 released", 0.5)):
            out = run(seed, scale)
            for score in ("whitened", "raw"):
                rep = out[score]
                g = rep.gdp
                print(f"| {name} | {seed} | {out['sigma']:.3f} | {out['accountant_mu']:.3f} | {out['predicted_mu']:.3f} "
                      f"| {score} | {rep.epsilon_lower:.3f} | {g.mu:.3f} ± {g.se:.3f} | {g.sd0 / out['sigma']:.3f} "
                      f"| {g.epsilon:.2f} [{g.epsilon_lower:.2f}, {g.epsilon_upper:.2f}] "
                      f"| {rep.accountant_epsilon:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
