"""The Hugging Face fine-tuning example (``examples/hf_finetune.py``) end to end, in quick mode.

- The four private runs (full fine-tuning and LoRA, flat clipping and AdaCliP) spend at most the
  target ε and improve the held-out loss on the private corpus over the pretrained model; with
  ``--save`` the base model and the LoRA runs' mid-run checkpoints are written, and ``--resume``
  finishes the LoRA runs from them with the same rows, down to the hash of the weights.
- ``--model`` starts from a tiny model saved with ``save_pretrained`` (a Llama, with a tokenizer
  saved next to it: another architecture, and the tokenizer-loading branch; the GPT-2 base that
  ``--resume`` loads has no tokenizer and takes the character tokenizer).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
T = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_finetune.py"
EPSILON = 8.0
NUM = r"([0-9.]+)"
ROW = re.compile(
    rf"^((?:full|lora)/(?:flat|adaclip))\s+([0-9,]+)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+ε={NUM} "
    r"\(δ=1e-05, σ=[0-9.]+, (\d+) steps\)\s+weights ([0-9a-f]{12})$",
    re.M,
)
BASE = re.compile(rf"^(pretrained|loaded|resumed base)\s+-\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+none", re.M)
RUNS = ["full/flat", "full/adaclip", "lora/flat", "lora/adaclip"]


def run(*args: str) -> str:
    return subprocess.run([sys.executable, str(EXAMPLE), "--quick", *args], capture_output=True, text=True,
                          check=True, timeout=300).stdout  # fmt: skip


def check(out: str, base_label: str) -> dict[str, tuple[str, ...]]:
    """The table: the base row, then one row per private run within the budget."""
    assert "tokenizer:" in out and "public:" in out and f"ε target {EPSILON:g}" in out, out
    base = BASE.findall(out)
    assert [b[0] for b in base] == [base_label], out
    rows = {r[0]: r for r in ROW.findall(out)}
    for name, row in rows.items():
        assert float(row[8]) <= EPSILON, (name, out)
        assert int(row[9]) > 0 and int(row[1].replace(",", "")) > 0
    return rows


def test_quick_example_trains_within_budget_and_resumes_the_lora_runs_bit_for_bit(tmp_path):
    out = run("--save", str(tmp_path))
    rows = check(out, "pretrained")
    assert list(rows) == RUNS, out
    pretrained_private_loss = float(BASE.findall(out)[0][4])
    for name, row in rows.items():
        assert float(row[5]) < pretrained_private_loss, (name, out)  # the private corpus is learnt
    assert int(rows["lora/flat"][1].replace(",", "")) < int(rows["full/flat"][1].replace(",", "")) / 4
    assert (tmp_path / "base" / "config.json").is_file()
    for strategy in ("flat", "adaclip"):
        for name in ("adapter_config.json", "adapter_model.safetensors", "dp_state.pt"):
            assert (tmp_path / f"lora-{strategy}" / name).is_file()

    resumed = run("--resume", str(tmp_path))
    again = check(resumed, "resumed base")
    assert list(again) == ["lora/flat", "lora/adaclip"], resumed
    for name in again:
        assert again[name] == rows[name], (name, out, resumed)  # losses, ε and the weights' hash


def test_quick_example_on_a_saved_model_and_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=32))  # fmt: skip
    model.save_pretrained(str(tmp_path))
    vocab = {"<pad>": 0, "<unk>": 1, "\n": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>").save_pretrained(str(tmp_path))

    out = run("--model", str(tmp_path))
    assert "model: LlamaForCausalLM; tokenizer: " in out and "'s, 98 ids" in out, out
    rows = check(out, "loaded")
    assert list(rows) == RUNS, out
