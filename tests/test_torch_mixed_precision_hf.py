"""Mixed precision on the Hugging Face models and on the fused-kernel path (``use_kernel=True``).

Tiny random-initialised GPT-2, Llama and BERT (the configs of ``test_torch_hf_models``, 2
layers, hidden 32; right-padded batches of 4; :func:`~adaclip_torch.losses.per_example_lm_loss`
and :func:`~adaclip_torch.losses.per_example_classification_loss`, ``loss_reduction="sum"``),
in bfloat16 parameters and as float32 parameters under ``torch.autocast(dtype=torch.bfloat16)``:

- per-example gradients (materialise and ghost) against one example at a time in the same
  precision, within 2 % of the largest entry: bfloat16 keeps 8 mantissa bits (relative rounding
  2⁻⁹ ≈ 2e-3 per operation) and the batched forward rounds differently from the one-example one;
  measured 4e-3 at most here, so 2 % leaves 5x headroom and still fails on a wrong row, a
  missing term or a wrong scale (errors of order 1);
- every clipped contribution ``c_i‖g_i‖`` ≤ C exactly (no slack: rounding may over-clip, never
  under-clip), with ``c_i`` the factors the engine computed (a spy on
  :func:`adaclip.strategies.group_clip_factors`) and ``g_i`` each example's float32 gradient as
  the sum computes it (the materialised rows; on the ghost path ``weighted_sum`` with a one-hot
  weight), normed in float64; with every rounding margin removed this check fails (contributions
  up to 1.0000001·C); the clipped sums equal ``Σ_i c_i g_i`` within 1e-5 of their largest entry
  (float32 sums of a few terms: 1e-7 measured);
- a whole private step, noise 0 and seeded noise, against the float32 step of the same model and
  batch: the released gradients within 2 % of the largest entry of the float32 release (the
  bfloat16 forward moves the gradients by up to 8e-3 of it here), and the noise, the noisy
  release minus the noise-free one, equal to the float32 step's within 1e-5 of its largest entry
  (float32 rounding, 1e-7 measured; noise drawn or added in bfloat16 would be off by 2e-3).

The fused kernels (``use_kernel=True``: the Triton kernels, on CPU in Triton's interpreter) get
the same checks on the units and factors they are handed (one σ = 1 step: its noise-free part
is ``Σ c_i g_i/B`` of those), and equal the core path in the same precision (bfloat16, float16,
autocast; flat clipping and the patent's AdaCliP, on a small MLP). ``opt.step()`` called inside
the autocast block: the library's norms and sums still run in float32
(:class:`adaclip_torch._precision.full_float32_precision` disables autocast; before it did,
ghost contributions reached 1.00005·C there and the materialised sums were 2e-3 off).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _import_kernels():
    """triton and the kernels, in Triton's interpreter when there is no CUDA device (as
    ``test_torch_kernel``: ``TRITON_INTERPRET=1`` only around the first import); ``None``
    without triton."""
    fresh = "triton" not in sys.modules
    previous = os.environ.get("TRITON_INTERPRET")
    if DEVICE == "cpu" and fresh:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        try:
            import triton  # noqa: F401
        except ImportError:
            if os.environ.get("ADACLIP_REQUIRE_KERNELS"):
                raise
            return None
        from adaclip_torch.kernels import triton_adaclip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return triton_adaclip


K = _import_kernels()  # before anything else imports triton (transformers' models do)
IN_PROCESS = K is not None and (DEVICE == "cuda" or K.INTERPRETED)
needs_kernels = pytest.mark.skipif(
    not IN_PROCESS,
    reason="no triton"
    if K is None
    else "triton was imported without the interpreter: see test_kernel_tests_in_subprocess",
)

import test_torch_hf_models as hf  # noqa: E402
from torch import nn  # noqa: E402

import adaclip.strategies as strategies  # noqa: E402
from adaclip_torch import AdaClip, FlatClip, kernels  # noqa: E402
from adaclip_torch._precision import full_float32_precision  # noqa: E402
from adaclip_torch.engines import StepInputs  # noqa: E402
from adaclip_torch.losses import per_example_classification_loss, per_example_lm_loss  # noqa: E402

pytestmark = pytest.mark.torch

MODELS = ("gpt2", "llama", "bert")
PRECISIONS = {"bf16-params": (torch.bfloat16, False), "autocast-bf16": (torch.float32, True)}
N = 4
SIGMA = 1.0
SEED = 7
GRAD_TOL = 2e-2  # of the largest entry: bfloat16 (see the module doc)
EXACT_TOL = 1e-5  # of the largest entry: float32 sums and noise


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Triton reads TRITON_INTERPRET again while an interpreted kernel runs: keep it set during
    this module's tests on CPU, and restore it afterwards (as ``test_torch_kernel``)."""
    if not IN_PROCESS or DEVICE == "cuda":
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.mark.skipif(IN_PROCESS or K is None, reason="the kernel tests ran in this process")
def test_kernel_tests_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "kernel", __file__],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(__file__)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "test_kernel_tests_in_subprocess" not in proc.stdout


# ------------------------------------------------------------------------------------ helpers
def build(name: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = hf.MODELS[name]().to(device=DEVICE, dtype=dtype)
    model.train()
    return model


def make_batch(name: str) -> dict[str, torch.Tensor]:
    """Four right-padded sequences (2..6 tokens; BERT with a label each)."""
    batch = hf.make_batch(name, N, torch.Generator().manual_seed(4))
    assert bool((batch["attention_mask"] == 0).any())  # padding in the batch
    return {k: v.to(DEVICE) for k, v in batch.items()}


def loss_of(name: str, model: nn.Module, batch: dict[str, torch.Tensor], autocast: bool) -> torch.Tensor:
    """Σ_i ℓ_i with the library's per-example losses (loss_reduction="sum")."""
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if name == "bert":
        return per_example_classification_loss(logits, batch["labels"])
    return per_example_lm_loss(logits, batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))


def one_at_a_time(name, model, batch, params, autocast) -> list[torch.Tensor]:
    """Per-example gradients ``(n, *p.shape)`` in float32, one example per backward."""
    rows = []
    for i in range(N):
        model.zero_grad(set_to_none=True)
        loss_of(name, model, {k: v[i : i + 1] for k, v in batch.items()}, autocast).backward()
        rows.append(
            [torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float() for p in params]
        )
    model.zero_grad(set_to_none=True)
    return [torch.stack([r[k] for r in rows]) for k in range(len(params))]


def sq_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """``‖g_i‖²`` over all tensors, in float64 (exact enough for float32 entries)."""
    return sum((g.double().flatten(1) ** 2).sum(1) for g in grads)


def weighted(grads: list[torch.Tensor], c: torch.Tensor) -> torch.Tensor:
    """``Σ_i c_i g_i`` flattened, in float64."""
    return torch.cat(
        [(c.double().view(-1, *[1] * (g.ndim - 1)) * g.double()).sum(0).flatten() for g in grads]
    )


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: float, scale: float, what: str) -> None:
    err = float((got.double() - want.double()).abs().max())
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:g} x {scale:.3g}"


@pytest.fixture
def factors(monkeypatch) -> list[torch.Tensor]:
    """The clip factors of every step the engines take (every path computes them with
    :func:`adaclip.strategies.group_clip_factors`, looked up at call time)."""
    seen: list[torch.Tensor] = []
    real = strategies.group_clip_factors

    def spy(strategy, sq):
        out = real(strategy, sq)
        seen.append(out[0].detach().clone())
        return out

    monkeypatch.setattr(strategies, "group_clip_factors", spy)
    return seen


def released(opt) -> list[torch.Tensor]:
    """Record the released gradients before they are cast to the parameters' dtype."""
    out: list[torch.Tensor] = []
    real = opt._as_grad

    def spy(g, p):
        out.append(g.detach().clone())
        return real(g, p)

    opt._as_grad = spy
    return out


def step(
    name: str, dtype, autocast: bool, path: str, sigma: float, clip: float
) -> tuple[torch.Tensor, FlatClip]:
    """One private step (lr 0) of a fresh model on the batch: the released gradient, flat, in the
    statistics dtype (float32) before the cast to the parameters' dtype."""
    model = build(name, dtype)
    kw = {"use_kernel": True} if path == "kernel" else {"per_sample_mode": path, "use_kernel": False}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=sigma,
                   expected_batch_size=float(N), max_grad_norm=clip, loss_reduction="sum", seed=SEED, **kw)  # fmt: skip
    out = released(opt)
    try:
        loss_of(name, model, make_batch(name), autocast).backward()
        opt.step()
    finally:
        opt.remove_hooks()
    assert opt.fused_kernels == (path == "kernel")
    for p in model.parameters():  # the release, rounded once to the parameters' dtype
        assert p.grad.dtype == dtype
    assert all(torch.equal(p.grad, g.to(dtype)) for p, g in zip(model.parameters(), out, strict=True))
    return torch.cat([g.flatten() for g in out]), opt


@functools.cache
def float32_clip(name: str) -> float:
    """The median per-example norm of the float32 model: about half the examples are clipped."""
    model = build(name, torch.float32)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                   expected_batch_size=float(N), max_grad_norm=1.0, loss_reduction="sum")  # fmt: skip
    try:
        _, per_example, _ = engine_step(opt, loss_of(name, model, make_batch(name), False))
    finally:
        opt.remove_hooks()
    return float(sq_norms(per_example).sqrt().median())


@functools.cache
def float32_step(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 model's release, noise 0, and its noise (σ = 1 release minus that)."""
    clip = float32_clip(name)
    free, _ = step(name, torch.float32, False, "materialise", 0.0, clip)
    noisy, _ = step(name, torch.float32, False, "materialise", SIGMA, clip)
    return free, noisy - free


# ------------------------------------------------------------------ Hugging Face, core paths
def engine_step(opt: FlatClip, loss: torch.Tensor):
    """``loss.backward()``, then the engine's clipped sums ``Σ_i c_i g_i / C``, its per-example
    gradients (``collect``) and each example's gradient as the sum computes it (a ghost layer's
    ``weighted_sum`` with a one-hot weight: the rounding of what is summed, which a ghost
    embedding's ``materialise``, accumulated in the parameters' dtype, does not have)."""
    loss.backward()
    state = opt.clip_state
    inputs = StepInputs(state, lambda s: s.transform(state, len(opt.params)), "zero", opt.grad_sample_hooks)
    sources = opt.engine.unit_sources(inputs, require=True)
    sums = opt.engine.clipped_sum(inputs, opt.strategy, sources)[: len(opt.params)]
    per_example = opt.engine.collect(inputs)
    eye = torch.eye(N, device=DEVICE)
    summed = [src if isinstance(src, torch.Tensor) else torch.stack([src[0].weighted_sum(src[1], e) for e in eye])
              for src in sources]  # fmt: skip
    opt.zero_grad()
    return sums, per_example, summed


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MODELS)
def test_hf_per_example_gradients_and_contributions(name, precision, factors):
    """Materialise and ghost: per-example gradients against one example at a time in the same
    precision (2 % of the largest entry), held in float32; every contribution the engine sums
    has norm ≤ C; the clipped sums are ``Σ c_i g_i`` of those gradients and factors."""
    dtype, autocast = PRECISIONS[precision]
    model = build(name, dtype)
    batch = make_batch(name)
    params = list(model.parameters())
    ref = one_at_a_time(name, model, batch, params, autocast)
    clip = float(sq_norms(ref).sqrt().median())
    scale = max(float(g.abs().max()) for g in ref)
    for mode in ("materialise", "ghost"):
        opt = FlatClip(torch.optim.SGD(params, lr=0.0), model, noise_multiplier=0.0, expected_batch_size=float(N),
                       max_grad_norm=clip, per_sample_mode=mode, loss_reduction="sum")  # fmt: skip
        try:
            sums, per_example, summed = engine_step(opt, loss_of(name, model, batch, autocast))
        finally:
            opt.remove_hooks()
        for k, (got, want) in enumerate(zip(per_example, ref, strict=True)):
            assert got.dtype == torch.float32
            assert_within(got, want, GRAD_TOL, scale, f"{mode}: per-example gradient of tensor {k}")
        c = factors[-1].double()
        assert bool((c < 1).any() and (c == 1).any())  # some examples clipped, some not
        contributions = c * sq_norms(summed).sqrt()
        assert bool((contributions <= clip).all()), f"{mode}: {(contributions / clip).tolist()} x C"
        got = torch.cat([s.flatten() for s in sums]).double() * clip
        want = weighted(summed, c)
        assert_within(got, want, EXACT_TOL, float(want.abs().max()), f"{mode}: clipped sum")


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MODELS)
def test_hf_private_step_matches_float32(name, precision, factors):
    """Materialise and ghost: the step's released gradient, noise 0 and σ = 1 (same seed),
    against the float32 step (2 % of the largest float32 entry); the noise equals the float32
    step's to float32 rounding (drawn and added in float32, cast once at the end)."""
    dtype, autocast = PRECISIONS[precision]
    free32, noise32 = float32_step(name)
    signal, noise = float(free32.abs().max()), float(noise32.abs().max())
    for path in ("materialise", "ghost"):
        free, _ = step(name, dtype, autocast, path, 0.0, float32_clip(name))
        noisy, _ = step(name, dtype, autocast, path, SIGMA, float32_clip(name))
        assert bool((factors[-1] < 1).any() and (factors[-1] == 1).any())  # some clipped, some not
        assert_within(free, free32, GRAD_TOL, signal, f"{path}: noise-free step")
        assert_within(noisy, free32 + noise32, GRAD_TOL, signal, f"{path}: noisy step")
        assert_within(noisy - free, noise32, EXACT_TOL, noise, f"{path}: noise")


# ------------------------------------------------------------------ Hugging Face, kernels
def kernel_calls(monkeypatch, name: str) -> list[dict]:
    """Record each call of the kernel release ``name``: the units, factors and output."""
    calls: list[dict] = []
    real = getattr(K, name)

    def spy(g, c, *args, **kw):
        out = real(g, c, *args, **kw)
        calls.append({"g": g.clone(), "c": c.clone(), "args": args, "kw": kw, "out": out})
        return out

    monkeypatch.setattr(K, name, spy)
    return calls


@needs_kernels
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", MODELS)
def test_hf_kernel_step(name, precision, monkeypatch):
    """``use_kernel=True``, σ = 1: the units the kernels are handed are float32, every
    contribution ``c_i‖g_i‖`` ≤ C, the release minus ``Σ c_i g_i/B`` is the float32 step's noise
    (to float32 rounding), and the noise-free part and the release match the float32 step
    (2 %)."""
    dtype, autocast = PRECISIONS[precision]
    free32, noise32 = float32_step(name)
    calls = kernel_calls(monkeypatch, "fused_flat_release")
    noisy, opt = step(name, dtype, autocast, "kernel", SIGMA, float32_clip(name))
    assert len(calls) == len(opt.params)  # one launch per parameter tensor
    units = [call["g"] for call in calls]
    c = calls[0]["c"].double()
    assert all(torch.equal(call["c"], calls[0]["c"]) for call in calls)  # one factor per example
    assert all(g.dtype == torch.float32 and g.shape[0] == N for g in units)
    clip = float32_clip(name)
    assert bool((c < 1).any())
    contributions = c * sq_norms(units).sqrt()
    assert bool((contributions <= clip).all()), f"{(contributions / clip).tolist()} x C"
    free = weighted(units, c) / N
    assert_within(noisy, torch.cat([call["out"].flatten() for call in calls]), 0.0, 1.0, "the release")
    assert_within(noisy - free, noise32, EXACT_TOL, float(noise32.abs().max()), "noise")
    assert_within(free, free32, GRAD_TOL, float(free32.abs().max()), "noise-free part")
    assert_within(noisy, free32 + noise32, GRAD_TOL, float(free32.abs().max()), "noisy step")


# ------------------------------------------------------------------ kernels on a small model
def _mlp_step(strategy: str, dtype, autocast: bool, use_kernel: bool, steps: int):
    """``steps`` private steps (lr 0) of a small MLP; the released gradients, flat, before the
    cast, and the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 4)).to(DEVICE, dtype)
    common = dict(
        noise_multiplier=1.3,
        expected_batch_size=6.0,
        seed=11,
        use_kernel=use_kernel,
        per_sample_mode="materialise",
    )  # the kernels' per-example gradients (ghost ones round less)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # the parameters stay: step 2 compares to rounding
    if strategy == "adaclip":
        opt = AdaClip(sgd, model, std_min=1e-3, std_max=0.3, beta_std=0.5, preset="patent", **common)
    else:
        opt = FlatClip(sgd, model, max_grad_norm=0.5, **common)
    gen = torch.Generator().manual_seed(2)
    out = released(opt)
    for _ in range(steps):
        x, y = (
            torch.randn(8, 16, generator=gen).to(DEVICE, dtype),
            torch.randint(0, 4, (8,), generator=gen).to(DEVICE),
        )
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        nn.functional.cross_entropy(logits.float(), y, reduction="sum").backward()
        opt.step()
        opt.zero_grad()
    assert opt.fused_kernels == use_kernel
    return torch.cat([g.flatten() for g in out]), opt


@needs_kernels
@pytest.mark.parametrize("strategy", ["flat", "adaclip"])
@pytest.mark.parametrize(
    "dtype, autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)],
    ids=["bf16-params", "fp16-params", "autocast-bf16"],
)  # fmt: skip
def test_kernel_path_equals_core_path_in_low_precision(strategy, dtype, autocast, monkeypatch):
    """Flat clipping (one step) and the patent's AdaCliP (two, the second on the updated moments),
    σ = 1.3, same seed, lr 0: the kernels release what the core path releases in the same
    precision and keep the same state (float32 rounding: 1e-5), and every contribution in the
    transformed space, ``c_i‖(g_i − m)/b‖`` with the kernels' own ``b``, is ≤ 1 (no slack)."""
    name, steps = ("fused_release", 2) if strategy == "adaclip" else ("fused_flat_release", 1)
    calls = kernel_calls(monkeypatch, name)
    fused, opt_fused = _mlp_step(strategy, dtype, autocast, True, steps)
    core, opt_core = _mlp_step(strategy, dtype, autocast, False, steps)
    k = len(opt_fused.params)  # one launch per tensor and step
    assert len(calls) == steps * k
    assert_within(fused, core, EXACT_TOL, float(core.abs().max()), "kernel vs core release")
    if strategy == "adaclip":  # the moments, from the released gradient only
        for a, b in zip(opt_core.clip_state.mean + opt_core.clip_state.std,
                        opt_fused.clip_state.mean + opt_fused.clip_state.std, strict=True):  # fmt: skip
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for s in range(steps):
        step_calls = calls[k * s : k * s + k]
        c = step_calls[0]["c"].double()
        sq = torch.zeros_like(c)
        for call in step_calls:
            g = call["g"].double()
            if strategy == "adaclip":
                mean, std = call["args"]
                b = K._release_scale(std, call["kw"]["std_sum"])  # the kernels' float32 b, bit for bit
                g = (g - mean.double()) / b.double()
            else:
                g = g / call["kw"]["max_grad_norm"]
            sq += (g**2).sum(1)
        assert bool((c < 1).any())
        assert bool((c * sq.sqrt() <= 1.0).all()), (c * sq.sqrt()).tolist()


# ------------------------------------------------------------------ opt.step() under autocast
@pytest.mark.parametrize("path", ["materialise", "ghost", pytest.param("kernel", marks=needs_kernels)])
def test_step_inside_autocast_still_clips_in_float32(path, factors):
    """The whole training step (forward, backward and ``opt.step()``) inside
    ``torch.autocast(bfloat16)``: the ghost norms and the clipped sums are matrix products,
    which autocast would run in bfloat16 (before the guard also disabled autocast: ghost
    contributions up to 1.00005·C, sums 2e-3 off). Every example clipped (C far below the
    norms): each contribution ≤ C, and the release is ``Σ c_i g_i/B`` to float32 rounding."""
    n, clip = 8, 1e-3
    model = build("gpt2", torch.float32)
    batch = hf.make_batch("gpt2", n, torch.Generator().manual_seed(4))
    kw = {"use_kernel": True} if path == "kernel" else {"per_sample_mode": path, "use_kernel": False}
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                   expected_batch_size=float(n), max_grad_norm=clip, loss_reduction="sum", **kw)  # fmt: skip
    out = released(opt)
    try:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            hf.loss_of("gpt2", model, {k: v.to(DEVICE) for k, v in batch.items()}).backward()
        per_example = opt.engine.collect(opt._engine_inputs())  # outside autocast: float32
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            opt.step()
    finally:
        opt.remove_hooks()
    c = factors[-1].double()
    assert bool((c < 1).all())
    contributions = c * sq_norms(per_example).sqrt()
    assert bool((contributions <= clip).all()), f"{(contributions / clip).tolist()} x C"
    want = weighted(per_example, c) / n
    assert_within(torch.cat([g.flatten() for g in out]), want, EXACT_TOL, float(want.abs().max()), "release")


def test_guard_disables_autocast_and_restores_it():
    """Inside :class:`full_float32_precision` autocast is off (products of float32 tensors are
    float32), nested guards included; on exit, also on an exception, it is back as it was.
    Autocast is per thread: a guard entered and left in another thread (with its own autocast)
    while this thread's guard is open leaves both threads' state right."""
    a = torch.randn(4, 4, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with full_float32_precision():
            assert not torch.is_autocast_enabled(DEVICE) and (a @ a).dtype == torch.float32
            with full_float32_precision():
                assert (a @ a).dtype == torch.float32
            assert (a @ a).dtype == torch.float32
            seen: list[torch.dtype] = []

            def other() -> None:
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    with full_float32_precision():
                        seen.append((a @ a).dtype)
                    seen.append((a @ a).dtype)

            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            assert seen == [torch.float32, torch.bfloat16]
            assert (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled(DEVICE) and (a @ a).dtype == torch.bfloat16
        with pytest.raises(ValueError, match="inside"):
            with full_float32_precision():
                raise ValueError("inside")
        assert (a @ a).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled(DEVICE)
    with full_float32_precision():
        assert not torch.is_autocast_enabled(DEVICE) and (a @ a).dtype == torch.float32


# ------------------------------------------------------------------ the flat-buffer API
@needs_kernels
def test_flat_buffer_kernels_refuse_bfloat16_naming_the_way_out():
    """The flat-buffer entry points read the caller's buffers in place and take float32 only:
    ``use_kernel=True`` with bfloat16 gradients is refused with the two ways out (widen them, or
    the torch path, which widens them itself), and the torch path gives the float32 step."""
    from adaclip.errors import InvalidGradientError

    g = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    z = torch.randn(10, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(max_grad_norm=1.0, noise_multiplier=0.5, expected_batch_size=3.0, noise=z)
    with pytest.raises(RuntimeError, match=r"float32 gradients.*bfloat16.*\.float\(\).*use_kernel=None"):
        kernels.fused_flat_step(g, use_kernel=True, **kw)
    with pytest.raises(InvalidGradientError, match=r"float32.*bfloat16.*\.float\(\)"):
        K.transformed_sq_norms(g, None, inv_b=1.0)
    low = kernels.fused_flat_step(g, use_kernel=None, **kw)
    wide = kernels.fused_flat_step(g.float(), use_kernel=True, **kw)
    assert low.dtype == torch.bfloat16  # the torch path: float32 arithmetic, rounded once
    torch.testing.assert_close(low.float(), wide, rtol=2**-8, atol=0.0)
