"""Private fine-tuning through the Hugging Face Trainer: Trainer -> PrivateTrainer (tiny, no download)."""
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from adaclip_torch.trainer import PrivateTrainer


class Texts(Dataset):  # token sequences of 8 to 16 tokens, counting up from a random start: one record each
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.randint(0, 99, (n, 1), generator=g) + torch.arange(16)) % 99 + 1
        self.lengths = torch.randint(8, 17, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, : self.lengths[i]].tolist()}


def collate(records):  # right padding, labels at -100 on the padding; an empty Poisson batch is {}
    if not records:
        return {}
    width = max(len(r["input_ids"]) for r in records)
    ids = torch.zeros(len(records), width, dtype=torch.long)
    for i, r in enumerate(records):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r["input_ids"]) for r in records])[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


collate.handles_empty_batch = True  # the collator says what an empty batch is

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="/tmp/private-gpt2", num_train_epochs=3, per_device_train_batch_size=16,
                         learning_rate=1e-3, eval_strategy="epoch", logging_strategy="epoch",
                         save_strategy="no", report_to=[], disable_tqdm=True)
trainer = PrivateTrainer(                       # was: Trainer(
    model=model, args=args, train_dataset=Texts(256, seed=1), eval_dataset=Texts(64, seed=2),
    data_collator=collate,
    target_epsilon=3.0, delta=1e-5,             # the privacy budget of the whole run
    averaging="ema",                            # evaluate and save an average of the parameters
)
print(trainer.private_optimizer.summary())      # what was built: noise, b, sigma, q, the accountant
trainer.train()                                 # logs "epsilon" with the learning rate; no training loss
print(trainer.evaluate())                       # the averaged model on the held-out records
print(f"epsilon = {trainer.epsilon:.3f}")
trainer.save_model()                            # the averaged model
