"""Private fine-tuning of a small GPT-2 on real text: full fine-tuning and LoRA, flat and AdaCliP.

A GPT-2-style model (``GPT2LMHeadModel`` from a ``GPT2Config``, random init, no download) is
pretrained **without privacy** on a public corpus, the docstrings of Python standard-library
modules, then fine-tuned **privately** on a shifted corpus, the docstrings of NumPy (its
``Parameters / ---------- / x : array_like`` style and its ``>>> np.`` examples are a genre of
their own). Both corpora ship with the interpreter, and a character-level tokenizer written here
needs no download. Four private runs start from the same pretrained model:

- full fine-tuning and LoRA (``peft``, r = 8, on every Linear/Conv1D layer but the LM head,
  with the final layer norm trained as ``modules_to_save``);
- flat clipping (``strategy="flat"``, DP-SGD) and AdaCliP (``strategy="adaclip"``);

each through :func:`adaclip_torch.make_private`, with the noise multiplier σ calibrated for the
target (ε, δ) over the whole run (once: the four runs share it), Poisson sampling in place of the
loader's and an accountant that refuses any step beyond the budget. The script prints the
per-token loss, the perplexity and the next-token accuracy on held-out text of both corpora,
before and after, and the ε each run spent.

What is protected: a *record* of the private data set is one window of at most 64 characters
(32 with ``--quick``) of one docstring (a docstring longer than that is cut into several
records, the last one shorter, so batches are padded). The guarantee is (ε, δ)-DP per record:
adding or removing one record changes the distribution of everything released (every noisy
step, hence the fine-tuned weights) by at most (ε, δ). A docstring made of k records is
protected at the group level k; to protect whole documents, make each document one unit
(``docs/user-level.md``). The pretraining data is public and costs no privacy; so is the
pretrained model. The held-out private docstrings are never trained on; the metrics printed on
them are a test set's, outside the guarantee, as usual.

    python examples/hf_finetune.py --quick            # seconds (CI)
    python examples/hf_finetune.py                    # a few minutes on 2 CPU cores
    python examples/hf_finetune.py --model PATH       # any local from_pretrained directory
    python examples/hf_finetune.py --quick --save DIR     # + checkpoints of the LoRA runs
    python examples/hf_finetune.py --quick --resume DIR   # resume them: same rows, bit for bit

``--save DIR`` writes the pretrained model (``DIR/base``, ``save_pretrained``), the run's
options (``DIR/run.json``: a resumed run takes them from there) and, halfway
through each LoRA run, its adapters (``save_pretrained``: the LoRA matrices and the
``modules_to_save`` copy, nothing of the frozen base) with the private optimizer's state, the
Poisson sampler's state and the RNG state (``DIR/lora-<strategy>/``). ``--resume DIR`` loads the
base from there (no pretraining), resumes each LoRA run from its checkpoint and finishes it: with
the same ``--seed`` the rows equal those of the uninterrupted run, bit for bit. The checkpoint
holds the noise generator's state because the runs are seeded (``seed=``, experiments): it
predicts the rest of the run's noise, so keep it as secret as the seed. Without a seed no
generator state is saved and a resumed run draws fresh noise.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import inspect
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from adaclip.accounting import calibrate_noise_multiplier
from adaclip.errors import NoiseReplayWarning
from adaclip_torch import DPOptimizer, make_private
from adaclip_torch.data import sample_rate_for, steps_per_epoch
from adaclip_torch.losses import per_example_lm_loss

warnings.filterwarnings("ignore", module="transformers")
warnings.filterwarnings("ignore", module="peft")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

PUBLIC_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "codecs", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email.message", "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "locale", "logging", "math", "operator", "os",
    "pathlib", "pickle", "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "signal",
    "smtplib", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "traceback", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile",
)  # fmt: skip
PRIVATE_MODULES = ("numpy", "numpy.fft", "numpy.linalg", "numpy.ma", "numpy.polynomial", "numpy.random")
STRATEGIES = ("flat", "adaclip")
#: the options a --resume takes from the --save directory's run.json
RUN_SETTINGS = ("quick", "epsilon", "delta", "max_grad_norm", "lr", "lora_lr", "per_sample_mode", "seed")


# ------------------------------------------------------------------------------------ data
def docstrings(module_names: Sequence[str], min_chars: int = 40) -> list[str]:
    """The docstrings of the modules, of their public functions and classes, and of those
    classes' public methods (each once, in a fixed order)."""
    seen: set[str] = set()
    out: list[str] = []

    def add(obj: object) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) >= min_chars and doc not in seen:
            seen.add(doc)
            out.append(doc)

    for name in module_names:
        module = importlib.import_module(name)
        add(module)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not str(getattr(obj, "__module__", "")).startswith(name.split(".")[0]):
                continue
            add(obj)
            if inspect.isclass(obj):
                for key, value in sorted(vars(obj).items()):
                    if not key.startswith("_") and callable(value):
                        add(value)
    return out


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...


class CharTokenizer:
    """Printable ASCII, one id per character: 0 is padding, 1 any other character, 2 a newline,
    3… the characters ``' '`` to ``'~'`` (a tab is a space). 98 ids."""

    pad_id = 0
    vocab_size = 3 + 95

    def encode(self, text: str) -> list[int]:
        ids = []
        for ch in text.replace("\t", " "):
            code = ord(ch)
            ids.append(2 if ch == "\n" else code - 32 + 3 if 32 <= code < 127 else 1)
        return ids


class HFTokenizer:
    """A tokenizer saved next to a ``--model`` directory (``AutoTokenizer``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def windows(docs: Sequence[str], tokenizer: Tokenizer, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document cut into records of ``length`` tokens (the last one shorter, right-padded
    with ``pad_id``); records of fewer than 2 tokens (nothing to predict) are dropped. Returns the
    token ids ``(N, length)`` and the attention mask."""
    rows: list[list[int]] = []
    for doc in docs:
        ids = tokenizer.encode(doc)
        rows.extend(ids[i : i + length] for i in range(0, len(ids), length) if len(ids) - i >= 2)
    out = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return out, mask


def split(docs: list[str], every: int = 10) -> tuple[list[str], list[str]]:
    """Documents, not records, are held out (every ``every``-th one), so no held-out text was
    trained on."""
    return [d for i, d in enumerate(docs) if i % every], [d for i, d in enumerate(docs) if i % every == 0]


# ------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class Setting:
    """The sizes of a run (``--quick`` or the full one)."""

    length: int  # tokens per record
    n_layer: int
    n_embd: int
    n_head: int
    pretrain_steps: int
    pretrain_batch: int
    private_records: int  # at most this many private training records (0: all)
    eval_records: int  # at most this many held-out records per corpus
    batch_size: int  # expected private batch (q·N)
    epochs: int


QUICK = Setting(length=32, n_layer=2, n_embd=64, n_head=4, pretrain_steps=120, pretrain_batch=32,
                private_records=1024, eval_records=256, batch_size=32, epochs=1)  # fmt: skip
FULL = Setting(length=64, n_layer=2, n_embd=96, n_head=4, pretrain_steps=800, pretrain_batch=32,
               private_records=8192, eval_records=1024, batch_size=128, epochs=1)  # fmt: skip


def build_model(setting: Setting, vocab_size: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=setting.length, n_embd=setting.n_embd,
                        n_layer=setting.n_layer, n_head=setting.n_head, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def load_model(path: str | Path) -> nn.Module:
    """Any causal LM saved with ``save_pretrained`` (weights and config, no download)."""
    return AutoModelForCausalLM.from_pretrained(str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved in ``path`` (``tokenizer_config.json`` or ``tokenizer.json``) if
    there is one, else the character tokenizer."""
    if not any((Path(path) / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        return CharTokenizer()
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path)))


def max_length(model: nn.Module) -> int | None:
    config = model.config  # type: ignore[union-attr]
    for key in ("n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, key, None), int):
            return int(getattr(config, key))
    return None


def lora(model: nn.Module, r: int = 8) -> nn.Module:
    """LoRA adapters on every Linear/Conv1D layer but the LM head (peft's ``"all-linear"``);
    the final norm is trained in full (``modules_to_save``); the rest is frozen."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    norms = [name for name, m in model.named_modules() if type(m).__name__.endswith("Norm")]  # the last: final
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear",
                        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
                        modules_to_save=norms[-1:])  # fmt: skip
    return get_peft_model(model, config)


def fingerprint(model: nn.Module) -> str:
    """A hash of the trainable parameters' bytes: equal for runs that agree bit for bit."""
    digest = hashlib.sha256()
    for p in model.parameters():
        if p.requires_grad:
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def count_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------ train / eval
def lm_loss(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, batch_reduction: str = "sum") -> torch.Tensor:
    """Σ_i (mean over example i's own tokens of the next-token cross-entropy).

    Why not ``model(ids, labels=...).loss``: Hugging Face's LM loss is the mean over *all* the
    batch's tokens, so example i's weight, 1/Σ_j|T_j|, depends on how long the *other* examples
    are. Our records are padded (a docstring's last window is short), so one added or removed
    record would rescale every other record's gradient, and the clipped sum could move by more
    than the clip norm C, the sensitivity the noise is calibrated for. ``per_example_lm_loss``
    reduces within each example first; its gradient for example i depends on example i alone.
    (``docs/huggingface.md``, "The loss: reduce per example".)"""
    logits = model(input_ids=ids, attention_mask=mask).logits  # no labels: no Hugging Face loss
    labels = ids.masked_fill(mask == 0, -100)
    return per_example_lm_loss(logits, labels, batch_reduction=batch_reduction)


@dataclass(frozen=True)
class Quality:
    loss: float  # mean next-token cross-entropy per token (nats)
    accuracy: float  # next-token accuracy

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def evaluate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, batch: int = 256) -> Quality:
    """Per-token loss and next-token accuracy over every target token of the held-out records
    (evaluation releases nothing during training: any reduction will do)."""
    was_training = model.training
    model.eval()
    total = correct = count = 0.0
    for i in range(0, len(ids), batch):
        x, m = ids[i : i + batch], mask[i : i + batch]
        logits = model(input_ids=x, attention_mask=m).logits[:, :-1].float()
        target, valid = x[:, 1:], m[:, 1:].bool()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        total += float(nll[valid].sum())
        correct += float((logits.argmax(-1) == target)[valid].sum())
        count += float(valid.sum())
    model.train(was_training)
    return Quality(total / count, correct / count)


def pretrain(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int, batch: int, seed: int) -> None:
    """Plain (non-private) AdamW on the public corpus, with a cosine schedule."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=max(steps, 1), pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(ids), (batch,), generator=gen)
        lm_loss(model, ids[idx], mask[idx], batch_reduction="mean").backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, pass after pass. The Poisson sampler draws one batch per call from
    its generator, so a sampler restored from a checkpoint continues the same sequence."""
    while True:
        yield from loader


@dataclass
class Run:
    model: nn.Module
    optimizer: DPOptimizer
    epsilon: float
    steps: int


def noise_multiplier(args: argparse.Namespace, setting: Setting, num_records: int) -> float:
    """σ for ``(args.epsilon, args.delta)`` over ``setting.epochs`` passes at
    ``q = batch_size / N``: what ``make_private(target_epsilon=..., epochs=...)`` would calibrate.
    The four runs share ``(q, T, ε, δ)``, hence σ: it is calibrated once, and each
    ``make_private`` gets it with the budget, which it checks the planned run against."""
    q = sample_rate_for(setting.batch_size, num_records)
    return calibrate_noise_multiplier(target_epsilon=args.epsilon, delta=args.delta, sample_rate=q,
                                      steps=setting.epochs * steps_per_epoch(q))  # fmt: skip


def private_finetune(base: nn.Module, data: TensorDataset, *, use_lora: bool, strategy: str, sigma: float | None,
                     args: argparse.Namespace, setting: Setting, save: Path | None = None,
                     resume: Path | None = None, noise_mechanism: str = "independent", averaging: Any = None,
                     prepare: Callable[[nn.Module, DPOptimizer], object] | None = None,
                     scale_adaptive_lr: bool | None = None) -> Run:  # fmt: skip
    """One private fine-tuning run from a copy of ``base``.

    ``make_private`` takes the noise multiplier σ with the budget ``(args.epsilon, args.delta)``
    (its accountant refuses any step beyond it) and returns the Poisson loader: each record is
    in each step's batch independently with probability ``q = batch_size / N``, the sampling
    the accountant assumes. The noise is independent across steps (DP-SGD's); with
    ``target_epsilon`` and ``epochs`` but no σ, ``make_private`` would choose banded noise. The loss is a sum of per-record terms (``loss_reduction="sum"``), each record's
    gradient is clipped (flat: to C; AdaCliP: centred and scaled per coordinate, then to norm 1)
    and the sum is noised once per step.

    ``save``: the LoRA checkpoint halfway (adapters, optimizer, sampler, RNG). ``resume``: start
    from that checkpoint instead of the beginning.

    For benchmarks (``benchmarks/utility/round3_hf.py``; the example itself keeps the defaults):
    ``sigma=None`` lets ``make_private`` calibrate σ for ``(args.epsilon, args.delta)`` over
    ``setting.epochs`` passes; ``noise_mechanism`` is make_private's (``"banded"`` with
    ``sigma=None``: the library chooses the number of bands b, samples with cyclic Poisson
    sampling and calibrates σ for ``⌈T/b⌉`` compositions at rate ``b·q``); ``averaging`` is
    make_private's (an EMA of the parameters, post-processing of the releases: read it with
    ``run.optimizer.averaged()``); ``prepare(model, optimizer)`` is called once before the first
    step (to attach more :class:`~adaclip_torch.ParameterAverage` s, say); ``scale_adaptive_lr``
    is make_private's (with banded noise and σ calibrated, AdamW's learning rate times ρ unless
    ``False``)."""
    from peft import PeftModel

    model = copy.deepcopy(base)
    if use_lora:
        model = PeftModel.from_pretrained(model, str(resume), is_trainable=True) if resume else lora(model)
    model.train()
    lr = args.lora_lr if use_lora else args.lr
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    loader = DataLoader(data, batch_size=setting.batch_size)
    model, private, loader = make_private(
        model, optimizer, loader, noise_multiplier=sigma, target_epsilon=args.epsilon, delta=args.delta,
        epochs=setting.epochs, noise_mechanism=noise_mechanism, strategy=strategy, max_grad_norm=args.max_grad_norm, loss_reduction="sum", seed=args.seed,
        per_sample_mode=args.per_sample_mode, averaging=averaging, scale_adaptive_lr=scale_adaptive_lr,
    )  # fmt: skip
    if prepare is not None:
        prepare(model, private)
    total = setting.epochs * len(loader)
    start, rng = 0, None
    if resume is not None:
        state = torch.load(resume / "dp_state.pt", weights_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NoiseReplayWarning)  # seeded: the noise replays, as intended
            private.load_state_dict(state["optimizer"])
        loader.batch_sampler.load_state_dict(state["sampler"])  # type: ignore[union-attr]
        start, rng = state["step"], state["rng"]
    stream = batches(loader)
    for step in range(start, total):
        checkpoint = save is not None and step == total // 2
        # the sampler's state before it draws this step's batch, the global RNG's (dropout) after:
        # a DataLoader draws its workers' base seed from the global RNG whenever a pass begins
        sampler_state = loader.batch_sampler.state_dict() if checkpoint else None  # type: ignore[union-attr]
        ids, mask = next(stream)
        if rng is not None:
            torch.set_rng_state(rng)
            rng = None
        if checkpoint:
            assert save is not None
            save.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(save))  # the adapters and the modules_to_save copy
            torch.save({"optimizer": private.state_dict(), "sampler": sampler_state, "step": step,
                        "rng": torch.get_rng_state()}, save / "dp_state.pt")  # fmt: skip
        if len(ids) == 0:  # a Poisson batch can be empty: the step releases noise only
            private.step(empty_batch=True)
        else:
            lm_loss(model, ids, mask).backward()
            private.step()
        private.zero_grad()
    assert private.accountant is not None
    return Run(model, private, private.accountant.epsilon(args.delta), total)


# ------------------------------------------------------------------------------------ main
def row(name: str, trainable: str, public: Quality, private: Quality, rest: str) -> str:
    return (f"{name:<13} {trainable:>9}  {public.loss:6.3f} {public.perplexity:7.2f} {public.accuracy:6.3f}  "
            f"{private.loss:6.3f} {private.perplexity:7.2f} {private.accuracy:6.3f}  {rest}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and few steps (CI)")
    parser.add_argument("--model", help="start from this from_pretrained directory instead of pretraining one")
    parser.add_argument("--pretrain-steps", type=int, help="public pretraining steps (default: the setting's; "
                        "0 with --model or --resume)")  # fmt: skip
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="C of flat clipping; AdaCliP's initial C")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of full fine-tuning")
    parser.add_argument("--lora-lr", type=float, default=5e-3, help="AdamW learning rate of LoRA")
    parser.add_argument("--per-sample-mode", default="auto", choices=("auto", "ghost", "materialise"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: best for these small models)")
    parser.add_argument("--save", type=Path, help="save the base model and mid-run LoRA checkpoints here")
    parser.add_argument("--resume", type=Path, help="resume the LoRA runs from a --save directory")
    args = parser.parse_args(argv)
    if args.resume and (args.model or args.save):
        parser.error("--resume takes the model from the checkpoint: no --model or --save with it")
    if args.resume:  # the saved run's settings (the data, σ, the seeds and the schedule follow from them)
        for key, value in json.loads((args.resume / "run.json").read_text()).items():
            setattr(args, key, value)
    setting = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    source = args.resume / "base" if args.resume else args.model
    tokenizer = load_tokenizer(source) if source else CharTokenizer()
    if source:
        model = load_model(source)
        steps = 0 if args.pretrain_steps is None else args.pretrain_steps
    else:
        model = build_model(setting, tokenizer.vocab_size, args.seed)
        steps = setting.pretrain_steps if args.pretrain_steps is None else args.pretrain_steps
    vocab = model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    if vocab < tokenizer.vocab_size:
        parser.error(f"the model's vocabulary ({vocab}) is smaller than the tokenizer's ({tokenizer.vocab_size})")
    longest = max_length(model)
    length = setting.length if longest is None else min(setting.length, longest)

    public_train, public_test = split(docstrings(PUBLIC_MODULES))
    private_train, private_test = split(docstrings(PRIVATE_MODULES))
    pub_ids, pub_mask = windows(public_train, tokenizer, length)
    priv_ids, priv_mask = windows(private_train, tokenizer, length)
    if setting.private_records:
        priv_ids, priv_mask = priv_ids[: setting.private_records], priv_mask[: setting.private_records]
    tests = [windows(docs, tokenizer, length) for docs in (public_test, private_test)]
    tests = [(i[: setting.eval_records], m[: setting.eval_records]) for i, m in tests]
    if min(len(pub_ids), len(priv_ids), len(tests[0][0]), len(tests[1][0])) == 0:
        parser.error("the tokenizer turned a corpus into no records of 2 tokens or more")
    kind = "characters" if isinstance(tokenizer, CharTokenizer) else f"{source}'s"
    print(f"model: {type(model).__name__}; tokenizer: {kind}, {tokenizer.vocab_size} ids")
    print(f"public: {len(public_train)} standard-library docstrings, {len(pub_ids)} records; private: "
          f"{len(private_train)} NumPy docstrings, {len(priv_ids)} records of <= {length} tokens; "
          f"held out: {len(tests[0][0])} + {len(tests[1][0])} records")  # fmt: skip

    if steps:
        pretrain(model, pub_ids, pub_mask, steps, setting.pretrain_batch, args.seed)
    if args.save:
        model.save_pretrained(str(args.save / "base"))
        (args.save / "run.json").write_text(json.dumps({key: getattr(args, key) for key in RUN_SETTINGS}))
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.tokenizer.save_pretrained(str(args.save / "base"))
    model.train()

    def quality(m: nn.Module) -> tuple[Quality, Quality]:
        return evaluate(m, *tests[0]), evaluate(m, *tests[1])

    header = (f"{'run':<13} {'trainable':>9}  {'public: loss   ppl    acc':<22}  {'private: loss  ppl    acc':<22}  "
              "privacy")  # fmt: skip
    print(f"\n{header}\n{'-' * len(header)}")
    label = "resumed base" if args.resume else "loaded" if args.model else "pretrained"
    how = f"public pretraining, {steps} steps" if steps else f"loaded from {source}"
    print(row(label, "-", *quality(model), f"none ({how})"), flush=True)
    data = TensorDataset(priv_ids, priv_mask)
    sigma = noise_multiplier(args, setting, len(data))
    for use_lora in (False, True):
        if args.resume and not use_lora:
            continue  # only the LoRA runs are checkpointed
        for strategy in STRATEGIES:
            name = f"{'lora' if use_lora else 'full'}/{strategy}"
            save = args.save / f"lora-{strategy}" if args.save and use_lora else None
            resume = args.resume / f"lora-{strategy}" if args.resume else None
            run = private_finetune(model, data, use_lora=use_lora, strategy=strategy, sigma=sigma, args=args,
                                   setting=setting, save=save, resume=resume)  # fmt: skip
            print(row(name, f"{count_trainable(run.model):,}", *quality(run.model),
                      f"ε={run.epsilon:.4f} (δ={args.delta:g}, σ={sigma:.3f}, {run.steps} steps)  "
                      f"weights {fingerprint(run.model)}"), flush=True)  # fmt: skip
    print(f"\nε target {args.epsilon:g} at δ={args.delta:g}; {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
