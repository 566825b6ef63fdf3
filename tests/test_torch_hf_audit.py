"""One-run white-box canary audit of private LoRA fine-tuning of a tiny GPT-2 (peft).

The canaries of :class:`adaclip_torch.audit.GradientCanaryAuditor` are Dirac units on the LoRA
matrices' coordinates (and the ``modules_to_save`` copy of the final norm): the trainable
parameters are what the private optimizer releases, so they are what is audited. The data is a
padded batch of token sequences through the whole model with the per-example LM loss; the
learning rate is 0, so the run audits the mechanism (the releases are exactly what the canaries
and the frozen model's data gradients make them; ``docs/auditing.md``).

The contract and its criteria are those of ``tests/test_torch_audit.py``:

- a correct run's one-run ``ε_emp`` stays within the accountant's ε, and so does the lower end of
  the GDP fit, while the canaries are seen (GDP ``μ`` > 0.5, ``√T/σ = 1`` in expectation) — on the
  materialised and the ghost path, with flat clipping and with AdaCliP;
- a run that releases σ/2 while its accountant records σ (the noise draws halved behind the
  accountant's back) is detected: the GDP fit's lower end exceeds the accountant's ε.

Full-batch steps (q = 1) keep the default-suite part short; the slow cases audit Poisson-sampled
runs (q = ½), where the canaries join each step with the data's rate.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
T = pytest.importorskip("transformers")

import adaclip_torch  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip_torch.audit import GradientCanaryAuditor  # noqa: E402
from adaclip_torch.data import PoissonBatchSampler  # noqa: E402
from adaclip_torch.losses import per_example_lm_loss  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),  # peft's call
]
warnings.filterwarnings("ignore", module="transformers")
T.logging.set_verbosity_error()

DELTA = 1e-5
V, L, N = 40, 8, 16


def lora_gpt2(seed: int) -> nn.Module:
    """GPT-2 (2 layers, hidden 32) with LoRA r = 8 on its Conv1D layers and the final norm in
    ``modules_to_save``: 5,696 trainable coordinates. B is moved off 0 so that A's data
    gradients are not 0 (a realistic nuisance for the canaries)."""
    torch.manual_seed(seed)
    base = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                                                      target_modules=["c_attn", "c_proj"],
                                                      modules_to_save=["transformer.ln_f"]))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.train()
    return model


def data(seed: int, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (n, L), generator=gen)
    mask = (torch.arange(L)[None, :] < torch.randint(2, L + 1, (n,), generator=gen)[:, None]).long()
    return ids * mask, mask


def audited_lora_run(strategy: str, *, sigma: float, mode: str = "ghost", steps: int = 4, q: float = 1.0,
                     num_canaries: int = 200, seed: int = 0, noise_scale: float = 1.0) -> GradientCanaryAuditor:  # fmt: skip
    """``steps`` steps at learning rate 0 under the auditor; Poisson batches of rate ``q`` of
    ``N`` records (q = 1: the full batch). ``noise_scale``: the optimizer's noise draws are
    multiplied by it while its accountant records σ (0.5: half the noise released)."""
    model = lora_gpt2(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    common = dict(noise_multiplier=sigma, expected_batch_size=q * N, loss_reduction="sum", accountant=Accountant("pld"),
                  sample_rate=q, seed=seed, per_sample_mode=mode)  # fmt: skip
    if strategy == "flat":
        opt = adaclip_torch.FlatClip(torch.optim.SGD(params, lr=0.0), model, max_grad_norm=1.0, **common)
    else:
        opt = adaclip_torch.AdaClip(torch.optim.SGD(params, lr=0.0), model, initial_max_grad_norm=1.0, **common)
    if noise_scale != 1.0:
        draw = opt._noise.standard_normal
        opt._noise.standard_normal = lambda like, **kw: [noise_scale * z for z in draw(like, **kw)]
    auditor = GradientCanaryAuditor(opt, num_canaries=num_canaries, seed=seed)
    ids, mask = data(seed)
    if q == 1.0:
        batches = [torch.arange(N)] * steps
    else:
        batches = [torch.tensor(b, dtype=torch.long) for b in
                   PoissonBatchSampler(N, q, num_steps=steps, generator=torch.Generator().manual_seed(seed))]  # fmt: skip
    for idx in batches:
        if len(idx) == 0:
            auditor.step(empty_batch=True)
        else:
            x, m = ids[idx], mask[idx]
            logits = model(input_ids=x, attention_mask=m).logits
            per_example_lm_loss(logits, x.masked_fill(m == 0, -100)).backward()
            auditor.step()
        opt.zero_grad()
    auditor.remove()
    opt.remove_hooks()
    return auditor


@pytest.mark.parametrize("mode", ["materialise", "ghost"])
@pytest.mark.parametrize("strategy", ["flat", "adaclip"])
def test_lora_audit_stays_within_the_accountant(strategy, mode):
    auditor = audited_lora_run(strategy, sigma=2.0, mode=mode)  # √T/σ = 1
    assert auditor.canaries.num_params == 5696
    rep = auditor.report(delta=DELTA)
    assert rep.accountant_epsilon is not None and not rep.exceeds_accountant, str(rep)
    assert rep.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.mu > 0.5, str(rep)  # the canaries are seen through the model's own gradients


def test_lora_audit_detects_half_the_noise():
    """σ = 4 accounted, σ/2 = 2 released: the canaries' μ doubles (0.5 → 1) and the GDP fit's
    lower end passes the accountant's ε."""
    rep = audited_lora_run("adaclip", sigma=4.0, num_canaries=300, seed=1, noise_scale=0.5).report(delta=DELTA)
    honest = audited_lora_run("adaclip", sigma=4.0, num_canaries=300, seed=1).report(delta=DELTA)
    assert rep.accountant_epsilon == honest.accountant_epsilon  # the accountant saw σ, not σ/2
    assert honest.gdp.epsilon_lower <= honest.accountant_epsilon, str(honest)
    assert rep.gdp.epsilon_lower > rep.accountant_epsilon, str(rep)
    assert rep.gdp.mu > 1.5 * honest.gdp.mu, (str(rep), str(honest))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["flat", "adaclip"])
def test_lora_audit_with_poisson_sampling(strategy):
    """q = ½ over 20 steps (the canaries sampled like the data), 1,000 canaries: within the
    accountant when correct (μ ≈ q√T/σ = 1.1), detected with half the noise released."""
    kw = dict(sigma=2.0, steps=20, q=0.5, num_canaries=1000)
    rep = audited_lora_run(strategy, seed=3, **kw).report(delta=DELTA)
    assert not rep.exceeds_accountant and rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert abs(rep.gdp.mu - 0.5 * math.sqrt(20) / 2.0) < 0.4, str(rep)
    half = audited_lora_run(strategy, seed=4, noise_scale=0.5, **kw).report(delta=DELTA)
    assert half.gdp.epsilon_lower > half.accountant_epsilon, str(half)
