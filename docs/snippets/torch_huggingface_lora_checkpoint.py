"""LoRA checkpoints: the adapters (peft) with the private optimizer's state and the sampler's.
Seeded (experiments), 3 steps + save + resume + 3 steps equals 6 steps straight, bit for bit."""
import tempfile
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from adaclip.errors import NoiseReplayWarning
from adaclip_torch import make_private
from adaclip_torch.losses import per_example_lm_loss

gen = torch.Generator().manual_seed(0)
ids = torch.randint(1, 100, (64, 16), generator=gen)
mask = (torch.arange(16)[None, :] < torch.randint(4, 17, (64, 1), generator=gen)).long()
data = TensorDataset(ids * mask, mask)  # 64 padded records


def base_model():  # the public base: the same weights every time (here: a seed; usually from_pretrained)
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def private(model):
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return make_private(model, opt, DataLoader(data, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
                        strategy="adaclip", loss_reduction="sum", seed=0)


def train(model, optimizer, loader, steps):
    batches = iter(loader)
    for _ in range(steps):
        x, m = next(batches)
        if len(x) == 0:
            optimizer.step(empty_batch=True)
        else:
            logits = model(input_ids=x, attention_mask=m).logits
            per_example_lm_loss(logits, x.masked_fill(m == 0, -100)).backward()
            optimizer.step()
        optimizer.zero_grad()


lora = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                  modules_to_save=["transformer.ln_f"])
straight = private(get_peft_model(base_model(), lora))
train(*straight, 4)

model, optimizer, loader = private(get_peft_model(base_model(), lora))
train(model, optimizer, loader, 2)
ckpt = Path(tempfile.mkdtemp())
model.save_pretrained(ckpt)  # the LoRA matrices and the modules_to_save copy: nothing of the base
torch.save({"optimizer": optimizer.state_dict(),  # clip statistics, Adam, accountant; seeded: the noise generator
            "sampler": loader.batch_sampler.state_dict()}, ckpt / "dp_state.pt")

resumed = PeftModel.from_pretrained(base_model(), ckpt, is_trainable=True)  # trainable, same parameter order
model2, optimizer2, loader2 = private(resumed)
state = torch.load(ckpt / "dp_state.pt", weights_only=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", NoiseReplayWarning)
    optimizer2.load_state_dict(state["optimizer"])  # seeded: warns that the noise replays
loader2.batch_sampler.load_state_dict(state["sampler"])
train(model2, optimizer2, loader2, 2)

same = all(torch.equal(a, b) for a, b in zip(straight[0].parameters(), model2.parameters()))
assert same and optimizer2.accountant.epsilon(1e-5) == straight[1].accountant.epsilon(1e-5)
print("resumed == uninterrupted, bit for bit:", same, "| warned:", [w.category.__name__ for w in caught],
      "| steps:", optimizer2.steps, "| epsilon:", round(optimizer2.accountant.epsilon(1e-5), 3))
