"""Full private fine-tuning of a Hugging Face causal LM, with padding (tiny config, no download)."""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from adaclip_torch import FlatClip
from adaclip_torch.losses import per_example_lm_loss

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
model.train()
optimizer = FlatClip(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
                     noise_multiplier=1.0, expected_batch_size=8, max_grad_norm=1.0,
                     per_sample_mode="ghost",   # or "materialise" / "auto": the same step
                     loss_reduction="sum", seed=0)  # the loss below is a sum over examples

gen = torch.Generator().manual_seed(1)
for step in range(3):
    ids = torch.randint(1, 100, (8, 16), generator=gen)
    lengths = torch.randint(4, 17, (8,), generator=gen)
    mask = (torch.arange(16)[None, :] < lengths[:, None]).long()   # right padding
    ids = ids * mask
    logits = model(input_ids=ids, attention_mask=mask).logits        # no labels: no HF loss
    labels = ids.masked_fill(mask == 0, -100)
    # each example's own token mean, summed over the examples: one example's gradient never
    # depends on the others' lengths (Hugging Face's loss averages over the batch's tokens)
    loss = per_example_lm_loss(logits, labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: mean per-example loss {loss.item() / 8:.3f}")

kinds = sorted({f"{type(m).__name__}: {k}" for m, k in optimizer.engine.modules.items()})
print("ghost path:", ", ".join(kinds))   # Conv1D blocks and the position embedding
