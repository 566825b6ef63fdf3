"""Hugging Face ``transformers`` models on every per-sample path.

Full fine-tuning of tiny random-initialised configs (2 layers, hidden 32, float64, no download):
GPT-2 (``Conv1D``, tied input/output embeddings, position ids of batch 1), BERT for sequence
classification (position ids of batch 1), T5 (embeddings shared by encoder, decoder and LM head;
relative attention bias indexed without a batch dim, with the sequence length equal to the batch
size), ViT (patch ``Conv2d`` inside a module owning the class token and position embeddings),
Llama (RMSNorm, rotary embeddings, gated MLP), and LoRA (peft) on GPT-2. For each model, with
padding, the per-example gradients and the clipped sums of ``per_sample_mode`` materialise,
ghost and auto equal a micro-batch reference (one example at a time: its gradient, clipped,
summed), noise 0. Then: the refusals of what cannot be routed, the per-example loss reductions
of :mod:`adaclip_torch.losses` and the sensitivity they restore.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import transformers as T
from torch import nn

from adaclip.errors import InvalidGradientError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.engines import GhostEngine, StepInputs
from adaclip_torch.grad_sample import GradSampleHooks, mark_batch_free
from adaclip_torch.losses import per_example_classification_loss, per_example_lm_loss

DT = torch.float64
V = 40
MODES = ("materialise", "ghost", "auto")
TOL = dict(rtol=1e-7, atol=1e-10)

warnings.filterwarnings("ignore", module="transformers")
T.logging.set_verbosity_error()


# ------------------------------------------------------------------------------------ models
def gpt2() -> nn.Module:
    return T.GPT2LMHeadModel(
        T.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    )  # fmt: skip


def bert() -> nn.Module:
    return T.BertForSequenceClassification(
        T.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )  # fmt: skip


def t5(attn: str) -> nn.Module:
    return T.T5ForConditionalGeneration(
        T.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0, attn_implementation=attn)
    )  # fmt: skip


def vit() -> nn.Module:
    return T.ViTForImageClassification(
        T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    )  # fmt: skip


def llama() -> nn.Module:
    return T.LlamaForCausalLM(
        T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    )  # fmt: skip


def gpt2_lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                              lora_dropout=0.0, fan_in_fan_out=True))  # fmt: skip
    with torch.no_grad():  # B starts at 0, which makes A's gradients 0: move it
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


# ------------------------------------------------------------------------------------ batches
def padded(n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (pad 0) and the attention mask of n right-padded sequences of 2..length tokens."""
    ids = torch.randint(1, V, (n, length), generator=gen)
    lengths = torch.randint(2, length + 1, (n,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def make_batch(kind: str, n: int, gen: torch.Generator, length: int = 6) -> dict[str, torch.Tensor]:
    if kind == "vit":
        return {"pixel_values": torch.randn(n, 3, 8, 8, generator=gen, dtype=DT),
                "labels": torch.randint(0, 3, (n,), generator=gen)}  # fmt: skip
    if kind == "t5":  # encoder length = n: a (L, L) bias index whose dim 0 equals the batch size
        ids, mask = padded(n, n, gen)
        dec, dmask = padded(n, 3, gen)
        return {"input_ids": ids, "attention_mask": mask, "labels": dec.masked_fill(dmask == 0, -100)}
    ids, mask = padded(n, length, gen)
    batch = {"input_ids": ids, "attention_mask": mask}
    if kind == "bert":
        batch["labels"] = torch.randint(0, 3, (n,), generator=gen)
    return batch


def loss_of(kind: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch loss: Σ_i ℓ_i (loss_reduction="sum") with the per-example LM loss, or Hugging
    Face's own classification loss, a mean over the examples (loss_reduction="mean")."""
    if kind in ("bert", "vit"):
        return model(**batch).loss
    if kind == "t5":
        logits = model(**batch).logits  # decoder inputs: the labels shifted right
        return per_example_lm_loss(logits, batch["labels"], shift=False)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return per_example_lm_loss(logits, labels)


def reduction_of(kind: str) -> str:
    return "mean" if kind in ("bert", "vit") else "sum"


MODELS = {
    "gpt2": gpt2,
    "bert": bert,
    "t5-sdpa": lambda: t5("sdpa"),
    "t5-eager": lambda: t5("eager"),
    "vit": vit,
    "llama": llama,
    "gpt2-lora": gpt2_lora,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().to(DT)
    model.train()
    return model


def reference(
    kind: str, model: nn.Module, batch: dict[str, torch.Tensor], params: list[nn.Parameter]
) -> list[torch.Tensor]:
    """Per-example gradients, one example at a time: ``(n, *p.shape)`` per parameter."""
    n = next(iter(batch.values())).shape[0]
    rows: list[list[torch.Tensor]] = []
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss_of(kind, model, {k: v[i : i + 1] for k, v in batch.items()}).backward()
        rows.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params])
    model.zero_grad(set_to_none=True)
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def engine_step(opt: FlatClip, loss: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``loss.backward()``, then the engine's clipped sums ``Σ_i c_i g_i / C`` and its per-example
    gradients (materialised from the ghost layers where needed). Nothing is stepped."""
    loss.backward()
    state = opt.clip_state
    inputs = StepInputs(state, lambda s: s.transform(state, len(opt.params)), "zero", opt.grad_sample_hooks)
    sources = opt.engine.unit_sources(inputs, require=True)
    sums = opt.engine.clipped_sum(inputs, opt.strategy, sources)[: len(opt.params)]
    per_example = opt.engine.collect(inputs)
    opt.zero_grad()
    return sums, per_example


def clipped_reference(ref: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref))
    factors = torch.clamp(clip / norms, max=1.0)
    return [(g * factors.view(-1, *[1] * (g.ndim - 1))).sum(0) / clip for g in ref]


def check_model(name: str, n: int, length: int = 6, seed: int | None = None) -> dict[str, FlatClip]:
    kind = name.split("-")[0] if name != "gpt2-lora" else "gpt2"
    model = build(name)
    gen = torch.Generator().manual_seed(n if seed is None else seed)
    batch = make_batch(kind, n, gen, length)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = reference(kind, model, batch, params)
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(1) for g in ref))
    assert bool((norms > 0).all())
    clip = float(norms.median())  # some examples clipped, some not
    expected = clipped_reference(ref, clip)
    scale = max(float(g.abs().max()) for g in ref)
    opts = {}
    for mode in MODES:
        opt = FlatClip(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=1.0, expected_batch_size=float(n),
                       max_grad_norm=clip, per_sample_mode=mode, loss_reduction=reduction_of(kind))  # fmt: skip
        try:
            sums, per_example = engine_step(opt, loss_of(kind, model, batch))
            for k, (got, want) in enumerate(zip(per_example, ref, strict=True)):
                # relative to the largest entry of any gradient (BERT's key bias has gradient 0 up to rounding)
                torch.testing.assert_close(
                    got / scale, want / scale, **TOL, msg=lambda m, k=k, mode=mode: f"{mode} {k}: {m}"
                )
            for got, want in zip(sums, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
            opts[mode] = opt
        finally:
            opt.remove_hooks()
    return opts


# ------------------------------------------------------------------------------- the models
@pytest.mark.parametrize("n", [1, 4])
def test_gpt2(n):
    """Position ids (1, L) broadcast over the batch, Conv1D blocks (ghost kind "linear_t"), the
    token embedding tied to lm_head (its per-example gradient is the sum of both uses; on the
    ghost path with the cross term between them)."""
    opts = check_model("gpt2", n)
    ghost = opts["ghost"].engine
    assert isinstance(ghost, GhostEngine)
    kinds = {type(m).__name__: k for m, k in ghost.modules.items()}
    assert kinds["Conv1D"] == "linear_t" and kinds["Embedding"] == "embedding"
    assert ghost.tied == {"transformer.wte.weight": ["Embedding.weight", "Linear.weight"]}


def test_bert():
    """BERT's position ids (1, L) with padding; Hugging Face's classification loss (a mean over
    the examples, per-example already) with loss_reduction="mean"."""
    check_model("bert", 4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_t5(attn):
    """T5: the relative attention bias (an (L, L) index, L = n here) added to the scores of every
    layer (eager) or folded into sdpa's mask; embeddings shared by encoder, decoder and LM head."""
    opts = check_model(f"t5-{attn}", 4)
    ghost = opts["ghost"].engine
    biases = [m for m in ghost.modules if isinstance(m, nn.Embedding) and m.num_embeddings == 32]
    assert len(biases) == 2  # both relative attention biases on the ghost path
    assert list(ghost.tied) == ["shared.weight"] and len(ghost.tied["shared.weight"]) == 4


def test_vit():
    """ViT: the patch Conv2d sits in ViTEmbeddings, which owns the class token and the position
    embeddings: the torch.func fallback covers the subtree, so it is materialised in ghost mode."""
    opts = check_model("vit", 3)
    assert not any(isinstance(m, nn.Conv2d) for m in opts["ghost"].engine.modules)


def test_llama():
    """Llama: RMSNorm (fallback), rotary embeddings (no parameters), gated MLP, GQA, padding."""
    check_model("llama", 3)


def test_gpt2_lora():
    """LoRA adapters (peft) on GPT-2's Conv1D layers; the base model frozen."""
    check_model("gpt2-lora", 3)


def test_adaptive_clipping_with_a_centre_agrees_across_paths():
    """AdaCliP (per-coordinate centre and scale) on GPT-2: the ghost Conv1D forms (the centre and
    scale transposed to the Linear layout) and the routed position embedding give the clipped sums
    of the materialised path."""
    model = build("gpt2")
    batch = make_batch("gpt2", 4, torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    state, sums = None, {}
    for mode in MODES:
        opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=1.0,
                      expected_batch_size=4.0, per_sample_mode=mode, loss_reduction="sum",
                      std_min=1e-3, std_max=0.05, preset="patent")  # fmt: skip
        try:
            if state is None:
                state = opt.clip_state
                state = state._replace(
                    mean=[1e-2 * torch.randn(m.shape, generator=gen, dtype=DT) for m in state.mean]
                )
            loss_of("gpt2", model, batch).backward()
            k = len(opt.params)
            inputs = StepInputs(
                state, lambda s, st=state, k=k: s.transform(st, k), "zero", opt.grad_sample_hooks
            )
            sources = opt.engine.unit_sources(inputs, require=True)
            if mode == "ghost":
                assert sum(isinstance(src, tuple) for src in sources) > 8  # Conv1D weights and biases, wpe
            sums[mode] = opt.engine.clipped_sum(inputs, opt.strategy, sources)
            opt.zero_grad()
        finally:
            opt.remove_hooks()
    for mode in ("ghost", "auto"):
        for got, want in zip(sums[mode], sums["materialise"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_tied_ghost_norm_bounds_the_norm_of_the_summed_uses():
    """TiedGhost on synthetic captures (two embeddings and a Linear sharing one weight): the norm
    is an upper bound within 1e-12 of the norm of the materialised sum, the cross terms included;
    unit 0's uses cancel exactly (norm 0), which only the direct recomputation gets right."""
    from adaclip_torch.ghost import GhostLayer, TiedGhost

    gen = torch.Generator().manual_seed(0)
    vocab, dim, n = 7, 5, 4
    emb, emb2, head = (
        nn.Embedding(vocab, dim, padding_idx=0).to(DT),
        nn.Embedding(vocab, dim).to(DT),
        nn.Linear(dim, vocab, bias=False).to(DT),
    )
    emb2.weight = head.weight = emb.weight
    ids, ids2 = torch.randint(0, vocab, (n, 3), generator=gen), torch.randint(0, vocab, (n, 2), generator=gen)
    delta, delta2 = (
        torch.randn(n, 3, dim, generator=gen, dtype=DT),
        torch.randn(n, 2, dim, generator=gen, dtype=DT),
    )
    x, e = torch.randn(n, 4, dim, generator=gen, dtype=DT), torch.randn(n, 4, vocab, generator=gen, dtype=DT)
    # unit 0: one token v with gradient w; the head's gradient -w at row v; the second embedding unused
    w = torch.randn(dim, generator=gen, dtype=DT)
    ids[0] = torch.tensor([3, 0, 0])
    delta[0] = 0.0
    delta[0, 0] = w
    x[0], e[0], delta2[0] = 0.0, 0.0, 0.0
    x[0, 0], e[0, 0, 3] = w / w.norm(), -w.norm()
    parts = [
        (GhostLayer(emb, "embedding", [(ids, delta)], DT, "ghost"), "weight"),
        (GhostLayer(emb2, "embedding", [(ids2, delta2)], DT, "ghost"), "weight"),
        (GhostLayer(head, "linear", [(x, e)], DT, "ghost"), "weight"),
    ]
    tied = TiedGhost(parts)
    g = tied.materialise("weight")
    assert float(g[0].abs().max()) < 1e-12
    for scale in (0.7, torch.tensor(2.0, dtype=DT)):
        exact = (g.flatten(1) ** 2).sum(1) / (scale * scale)
        bound = tied.norm("weight", None, scale)
        assert bool((bound >= exact).all()) and float(bound[0]) < 1e-20
        torch.testing.assert_close(bound, exact, rtol=1e-12, atol=1e-20)
        per_module = sum(layer.norm(pname, None, scale) for layer, pname in parts)
        assert float(per_module[0]) > 1.0  # without the cross term unit 0 would be clipped for nothing
    centre, scale = (
        torch.randn(vocab, dim, generator=gen, dtype=DT),
        torch.rand(vocab, dim, generator=gen, dtype=DT) + 0.5,
    )
    exact = (((g - centre) / scale).flatten(1) ** 2).sum(1)
    torch.testing.assert_close(tied.norm("weight", centre, scale), exact, rtol=1e-12, atol=0.0)
    c = torch.rand(n, generator=gen, dtype=DT)
    torch.testing.assert_close(tied.weighted_sum("weight", c), (c[:, None, None] * g).sum(0))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [2, 5, 7])
def test_models_sweep(name, n):
    """More batch sizes for every model (T5: the encoder length follows n)."""
    check_model(name, n)


# ------------------------------------------------------------------------------- refusals
class PosModel(nn.Module):
    """A token embedding plus a position embedding called on ids of batch 1; ``use`` picks how
    the position embedding meets the batch."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.tok = nn.Embedding(7, 4)
        self.pos = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 3)
        self.use = use

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        p = self.pos(torch.arange(ids.shape[1])[None])  # (1, L, D)
        if self.use == "matmul":
            h = h + torch.matmul(h, p.transpose(1, 2)) @ p
        elif self.use == "side":
            return self.head(h + p).sum() + (p**2).sum()  # (p²).sum() reaches the loss without the batch
        elif self.use == "expand":
            h = torch.cat([p.expand(ids.shape[0], -1, -1), h], dim=1)
        else:
            h = h + p
        return self.head(h).sum()


def test_unsupported_use_is_refused_in_the_forward_naming_the_module():
    model = PosModel("matmul").to(DT)
    with GradSampleHooks(model, loss_reduction="sum"):
        with pytest.raises(
            InvalidGradientError, match=r"Embedding `pos`.*matmul.*model\.pos\.requires_grad_\(False\)"
        ):
            model(torch.randint(0, 7, (3, 5)))
        model.pos.requires_grad_(False)  # the way out
        model(torch.randint(0, 7, (3, 5))).backward()
        assert model.tok.weight.grad_sample.shape == (3, 7, 4)


def test_gradient_that_does_not_meet_the_batch_is_refused():
    model = PosModel("side").to(DT)
    with GradSampleHooks(model, loss_reduction="sum"):
        loss = model(torch.randint(0, 7, (3, 5)))
        with pytest.raises(InvalidGradientError, match="Embedding `pos`.*cannot be attributed"):
            loss.backward()


@pytest.mark.parametrize("use", ["add", "expand"])
def test_batch_one_position_embedding_on_a_plain_model(use):
    """Both ways of meeting the batch (broadcast, explicit expand) give the micro-batch gradients."""
    torch.manual_seed(0)
    model = PosModel(use).to(DT)
    ids = torch.randint(0, 7, (4, 5))
    ref = {}
    for i in range(4):
        model.zero_grad()
        model(ids[i : i + 1]).backward()
        for k, p in model.named_parameters():
            ref.setdefault(k, []).append(p.grad.clone())
    model.zero_grad()
    with GradSampleHooks(model, loss_reduction="sum"):
        model(ids).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad_sample, torch.stack(ref[k]), **TOL)


class RelBias(nn.Module):
    """Scores plus a relative-position bias indexed by an (L, L) matrix: no batch dim."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.bias = nn.Embedding(2 * length - 1, 1)
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        idx = torch.arange(length)[None, :] - torch.arange(length)[:, None] + length - 1
        h = self.proj(x)
        scores = h @ h.transpose(1, 2) + self.bias(idx).squeeze(-1)
        return (scores.softmax(-1) @ h).pow(2).sum()


def test_mark_batch_free_for_an_index_without_batch_dim():
    """With L = n the (L, L) index looks batched; declared batch-free it is routed correctly."""
    torch.manual_seed(0)
    model = RelBias(4).to(DT)
    x = torch.randn(4, 4, 3, dtype=DT)
    ref = {}
    for i in range(4):
        model.zero_grad()
        model(x[i : i + 1]).backward()
        for k, p in model.named_parameters():
            ref.setdefault(k, []).append(p.grad.clone())
    model.zero_grad()
    mark_batch_free(model.bias)
    with GradSampleHooks(model, loss_reduction="sum"):
        model(x).backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad_sample, torch.stack(ref[k]), **TOL)


# ------------------------------------------------------------------------------- the loss
def test_per_example_losses_match_hugging_face_without_padding():
    """Equal lengths, no padding: the per-example token means averaged over the batch are Hugging
    Face's token mean; the classification loss is the plain mean."""
    model = build("gpt2")
    ids = torch.randint(1, V, (3, 6), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    # (Hugging Face computes its loss in float32, even for float64 logits)
    torch.testing.assert_close(per_example_lm_loss(out.logits, ids, batch_reduction="mean").float(), out.loss)
    per = per_example_lm_loss(out.logits, ids, batch_reduction="none")
    assert per.shape == (3,)
    logits, y = torch.randn(5, 3, dtype=DT), torch.tensor([0, 2, -100, 1, 1])
    per = per_example_classification_loss(logits, y, batch_reduction="none")
    assert float(per[2]) == 0.0
    torch.testing.assert_close(
        per_example_classification_loss(logits, y, batch_reduction="mean"), per.sum() / 5
    )


def clipped_sum(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], clip: float, reduction: str
) -> torch.Tensor:
    params = list(model.parameters())
    opt = FlatClip(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=1.0, expected_batch_size=4.0,
                   max_grad_norm=clip, loss_reduction=reduction)  # fmt: skip
    try:
        sums, _ = engine_step(opt, loss_fn())
    finally:
        opt.remove_hooks()
    return torch.cat([s.flatten() for s in sums]) * clip  # Σ_i c_i g_i


def test_one_example_moves_the_clipped_sum_by_at_most_the_clip_norm():
    """Neighbouring batches (one long example added to three copies of a short padded one), noise
    0: with the per-example loss the clipped sums differ by the added example's clipped gradient
    (norm ≤ C); with Hugging Face's batch token mean (and loss_reduction="mean") the others'
    contributions are rescaled by the new token count too, and the difference exceeds C."""
    model = build("gpt2")
    gen = torch.Generator().manual_seed(3)
    short = torch.randint(1, V, (1, 8), generator=gen)
    long = torch.randint(1, V, (1, 8), generator=gen)
    ids = torch.cat([short, short, short, long])
    mask = torch.ones_like(ids)
    mask[:3, 2:] = 0
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)

    def ours(k: int) -> torch.Tensor:
        logits = model(input_ids=ids[:k], attention_mask=mask[:k]).logits
        return per_example_lm_loss(logits, labels[:k])

    def hugging_face(k: int) -> torch.Tensor:
        return model(input_ids=ids[:k], attention_mask=mask[:k], labels=labels[:k]).loss

    clip = 10.0  # per-example norms here: 13.0 (short, clipped) and 4.7 (long)
    diff = clipped_sum(model, lambda: ours(4), clip, "sum") - clipped_sum(model, lambda: ours(3), clip, "sum")
    assert float(diff.norm()) <= clip * (1 + 1e-9)
    diff = clipped_sum(model, lambda: hugging_face(4), clip, "mean") - clipped_sum(
        model, lambda: hugging_face(3), clip, "mean"
    )
    assert float(diff.norm()) > clip


@pytest.mark.slow
def test_random_batch_sizes_lengths_and_padding():
    """Hypothesis over the batch size, the sequence length and the padding (each example's
    length is drawn from the seed): every path equals the one-example-at-a-time reference."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(name=st.sampled_from(["gpt2", "bert", "llama", "gpt2-lora"]), n=st.integers(1, 6),
           length=st.integers(2, 12), seed=st.integers(0, 10_000))
    def check(name: str, n: int, length: int, seed: int) -> None:
        check_model(name, n, length=length, seed=seed)

    check()
