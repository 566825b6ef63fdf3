"""Peak memory and step time with and without activation checkpointing, private and not.

A GPT-2-style model (random init from a ``GPT2Config``: 4 layers, hidden 256, 4 heads, vocab
1,000, 128 tokens) at batch 16, full fine-tuning with SGD. Four configurations, each in a fresh
process (so that one's allocations do not hide another's peak): non-private and private
(``FlatClip``, ``per_sample_mode="auto"``, σ = 1) × checkpointing off and on (Hugging Face's
``gradient_checkpointing_enable``/``activation_checkpointing_enable``, non-reentrant). Peak
memory is the growth of the resident set over two steps (``benchmarks/_memory.py``); the step
time is the median of ``--steps`` timed steps after three warm-up steps.

    python benchmarks/checkpointing_memory.py            # the table (about 2 minutes on 2 cores)
    python benchmarks/checkpointing_memory.py --quick    # a smoke run (tiny model)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings

CONFIGS = [(private, ckpt) for private in (False, True) for ckpt in (False, True)]


def _one(private: bool, checkpointing: bool, quick: bool, steps: int) -> dict[str, float]:
    import pathlib

    import torch
    import transformers as T

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from _memory import peak_growth_mib

    from adaclip_torch import FlatClip
    from adaclip_torch.losses import per_example_lm_loss

    warnings.filterwarnings("ignore")
    T.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers, hidden, seq, batch, vocab = (1, 32, 16, 4, 100) if quick else (4, 256, 128, 16, 1000)
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                                           n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
    model.train()
    if checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt = FlatClip(sgd, model, noise_multiplier=1.0, expected_batch_size=float(batch), max_grad_norm=1.0,
                   loss_reduction="sum") if private else sgd  # fmt: skip
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        logits = model(input_ids=ids).logits
        per_example_lm_loss(logits, ids).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # warm-up: the allocator reaches its steady state first
        step()
    peak = peak_growth_mib(step, torch.device("cpu"))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_mib": peak, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model (a smoke run, not a measurement)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    ap.add_argument("--one", nargs=2, type=int, metavar=("PRIVATE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(_one(bool(args.one[0]), bool(args.one[1]), args.quick, args.steps)))
        return
    rows = {}
    for private, ckpt in CONFIGS:
        cmd = [sys.executable, __file__, "--one", str(int(private)), str(int(ckpt)), "--steps", str(args.steps)]
        if args.quick:
            cmd.append("--quick")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows[(private, ckpt)] = json.loads(out)
        print(f"{'private' if private else 'non-private'}, checkpointing {'on' if ckpt else 'off'}: "
              f"{rows[(private, ckpt)]}", file=sys.stderr)  # fmt: skip
    print("| training | checkpointing | peak memory growth (MiB) | step (s) | memory / without | time / without |")
    print("|---|---|---|---|---|---|")
    for private, ckpt in CONFIGS:
        r, base = rows[(private, ckpt)], rows[(private, False)]
        print(f"| {'private (FlatClip, auto)' if private else 'non-private'} | {'on' if ckpt else 'off'} | "
              f"{r['peak_mib']:.0f} | {r['step_s']:.3f} | {r['peak_mib'] / base['peak_mib']:.2f} | "
              f"{r['step_s'] / base['step_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
