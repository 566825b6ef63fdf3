"""The accountant hook: record every training step exactly once, outside ``jax.jit``.

Accounting is Python-side bookkeeping (``dp-accounting`` is not traceable), so it lives in
the training loop, around the jitted step, not inside the transformation::

    tracker = adaclip_jax.PrivacyTracker(accountant, sample_rate=q, noise_multiplier=schedule)

    @jax.jit
    def train_step(params, opt_state, batch, *, noise_multiplier):
        grads = adaclip_jax.per_example_grads(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, noise_multiplier=noise_multiplier)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = tracker.step(train_step, params, opt_state, batch)
        print(tracker.epsilon(1e-5))

:meth:`PrivacyTracker.step` computes the planned ``σ_t``, checks the budget *before* running
the step (raising :class:`~adaclip.errors.BudgetExceededError`, nothing run or recorded),
runs the step with ``noise_multiplier=σ_t``, then reads the σ the transformation actually
used from the returned state (``AdaClipState.last_noise_multiplier``) and records that σ: the
accountant is told what was used, not what was asked for. A mismatch (σ used below the
planned σ, a step whose result holds no state) is recorded conservatively and then raised.
A step that raises is recorded too: the tracker cannot know whether a release left it. A
seeded state whose key an earlier step already used (restored, or reused after a failure)
warns :class:`~adaclip.errors.NoiseReplayWarning` before the step runs.

With banded correlated noise (``PrivacyTracker(..., bands=b)``, the transformation built with
``noise_mechanism="banded", bands=b`` and cyclic Poisson masks) the run is accounted as
``⌈T/b⌉`` compositions at rate ``p = b·q`` (:mod:`adaclip.correlated.mechanism`): the tracker
checks the budget and records one composition at the first step of each cycle of ``b`` steps,
and nothing at the others.
"""

from __future__ import annotations

import collections
import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip.accounting import keeper as _keeper
from adaclip.accounting._adoption import warn_if_mechanism_adopted
from adaclip.correlated.mechanism import accounted_sample_rate
from adaclip.errors import InvalidHyperparameterError, NoiseReplayWarning
from adaclip.strategies import validate_sample_rate
from adaclip_jax._state import _find_states

__all__ = ["PrivacyTracker"]


def _as_sigma(value: Any, step: int) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(
            f"the noise schedule returned {value!r} at step {step}; expected a number"
        ) from None
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(
            f"noise_multiplier must be finite and >= 0, got {x!r} at step {step}"
        )
    return x


def _float32_at_least(sigma: float) -> jnp.ndarray:
    """``σ`` as a float32 scalar, rounded *up* so the noise used is never below the σ accounted."""
    x = np.float32(sigma)
    if float(x) < sigma:
        x = np.nextafter(x, np.float32(np.inf))
    return jnp.asarray(x, jnp.float32)


def _float32_at_most(sigma: float) -> float:
    """The largest float32 ``<= σ``: a σ stored in float32 that is at least this equals σ up to
    float32 rounding."""
    x = np.float32(sigma)
    if float(x) > sigma:
        x = np.nextafter(x, np.float32(-np.inf))
    return float(x)


#: Fingerprints of the seeded noise keys that steps run through a tracker were given in this
#: process (the last :data:`_REPLAY_WINDOW`), to warn when one comes back.
_REPLAY_WINDOW = 1 << 16
_seen_keys: collections.OrderedDict[bytes, None] = collections.OrderedDict()
_seen_keys_lock = threading.Lock()


def _warn_on_replayed_keys(inputs: Any) -> None:
    """Warn :class:`~adaclip.errors.NoiseReplayWarning` if a seeded :class:`AdaClipState` among
    the step's inputs carries a key already given to an earlier step: a state restored from a
    checkpoint, or reused after a failed step, draws the same noise again."""
    replayed = False
    for state in _find_states(inputs):
        if not bool(np.asarray(state.seeded)):
            continue
        key = state.key
        data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
        fingerprint = np.asarray(data).tobytes()
        with _seen_keys_lock:
            replayed |= fingerprint in _seen_keys
            _seen_keys[fingerprint] = None
            _seen_keys.move_to_end(fingerprint)
            while len(_seen_keys) > _REPLAY_WINDOW:
                _seen_keys.popitem(last=False)
    if replayed:
        warnings.warn(
            NoiseReplayWarning(
                "this step's opt_state carries a noise key an earlier step already used: the state was "
                "restored from a checkpoint or reused, so the step replays that noise. If the earlier "
                "release was kept or seen, the difference of the two cancels it. Call "
                "adaclip_jax.refresh_key on a restored state, or use secure_mode=True."
            ),
            stacklevel=3,
        )


def _bands_of(state: Any) -> int:
    """The number of bands of the noise that made an :class:`AdaClipState` (1: independent)."""
    buffers = getattr(state, "noise_buffers", None)
    return 1 if buffers is None else len(buffers) + 1


def _sigmas_used(result: Any) -> list[float]:
    """``last_noise_multiplier`` of every :class:`AdaClipState` in ``result`` (host values)."""
    return [float(np.asarray(s.last_noise_multiplier)) for s in _find_states(result)]


class PrivacyTracker:
    """Couples a training loop to an :class:`adaclip.accounting.Accountant`.

    Args:
      accountant: an ``Accountant`` (anything with ``step``, ``would_exceed``, ``epsilon``,
        ``state_dict``, ``load_state_dict``), possibly with a budget (``target_epsilon``).
      sample_rate: ``q``, the probability that a unit joins a step (``B̄/N``).
      noise_multiplier: ``σ``, a schedule from :mod:`adaclip.schedules` (anything with
        ``at(step).noise_multiplier``), or a function ``step -> σ_t`` of a Python int.
      start_step: the index of the first step (to resume; :meth:`load_state_dict` sets it).
      bands: ``b``, the bands of the transformation's noise (``noise_mechanism="banded",
        bands=b``; 1: independent noise). With ``b > 1`` the units must be drawn by cyclic
        Poisson sampling with the same ``b`` (:func:`adaclip_jax.cyclic_poisson_mask`), the
        accountant records ``(p = b·q, σ)`` once per cycle of ``b`` steps, at its first step
        (after that step's update, as for ``b = 1``), and the budget is checked only then.
        ``b·q > 1`` and a noise schedule (the factorisation needs one σ: pass a number) are
        refused. The first step after construction or :meth:`load_state_dict` always opens a
        cycle, whatever its index: a restored tracker never under-counts (it may count one
        composition more than an uninterrupted run). :meth:`step` refuses a state whose
        noise has another number of bands.

    The step function given to :meth:`step` must return the new optimizer state of an
    :mod:`adaclip_jax` transformation somewhere in its result (``(params, opt_state)`` is
    fine): the tracker records the σ that state says was used, not the σ it asked for.
    """

    def __init__(
        self, accountant: Any, *, sample_rate: float, noise_multiplier: Any, start_step: int = 0, bands: int = 1
    ):
        q = validate_sample_rate(sample_rate)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise InvalidHyperparameterError(f"start_step must be an int >= 0, got {start_step!r}")
        rate = accounted_sample_rate(q, bands)  # checks bands, refuses b·q > 1
        schedule = hasattr(noise_multiplier, "at") or callable(noise_multiplier)
        if not schedule:
            _as_sigma(noise_multiplier, 0)
        elif bands > 1:
            raise InvalidHyperparameterError(
                "bands > 1 (banded noise) needs one σ for the whole run: pass noise_multiplier as a number"
            )
        self.accountant = accountant
        self.sample_rate = q
        self.bands = int(bands)
        self._rate = q if self.bands == 1 else rate
        self._schedule = noise_multiplier
        self._steps = start_step
        self._cycle = _keeper.Cycle(self.bands, start_step)  # a composition per cycle of b steps

    @property
    def steps(self) -> int:
        """Number of steps run through the tracker (the index of the next step); with
        ``bands > 1`` the accountant records one composition per cycle of ``b`` of them."""
        return self._steps

    @property
    def accounted_sample_rate(self) -> float:
        """The rate the accountant records: ``q``, or ``p = b·q`` with ``bands = b > 1`` (also
        the ``group_rate`` of :func:`adaclip_jax.cyclic_poisson_mask`)."""
        return self._rate

    def records_now(self) -> bool:
        """Whether the next step opens a cycle (is checked against the budget and recorded):
        always for ``bands = 1``."""
        return self._cycle.records_at(self._steps)

    def noise_multiplier_at(self, step: int) -> float:
        """``σ_t`` of step ``step``."""
        s = self._schedule
        if hasattr(s, "at"):
            value = s.at(step).noise_multiplier
        elif callable(s):
            value = s(step)
        else:
            value = s
        return _as_sigma(value, step)

    def check_budget(self) -> float:
        """``σ_t`` of the next step; raises ``BudgetExceededError`` if recording it would exceed
        the budget (with ``bands > 1``: checked only at the first step of a cycle, the others
        are covered by its composition)."""
        sigma = self.noise_multiplier_at(self._steps)
        _keeper.refuse(self.accountant, sigma, self._rate, step=self._steps, records=self.records_now(),
                     explain=self._explain)  # fmt: skip
        return sigma

    def _explain(self) -> str:
        """The tracker's side of a refusal: the rate it accounts and the steps it has run."""
        rate = _keeper.accounted_rate_words(self.sample_rate, self.bands, self._rate)
        if self.bands == 1:
            rate += ", independent noise"
        return f"; this tracker accounts each composition at {rate} and has run {self._steps} step(s)"

    def _check_bands(self, states: list[Any]) -> int | None:
        """The bands of the first state in ``states`` whose noise has another number of bands
        than the tracker (``None``: all agree)."""
        for state in states:
            b = _bands_of(state)
            if b != self.bands:
                return b
        return None

    def _bands_error(self, found: int, where: str) -> InvalidHyperparameterError:
        return InvalidHyperparameterError(
            f"{where} holds an AdaClipState whose noise has {found} band(s) but this tracker accounts "
            f"for {self.bands}: build the transformation with noise_mechanism='banded', bands=b and the "
            "tracker with bands=b (the same b), or neither"
        )

    def step(self, update_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``update_fn(*args, noise_multiplier=σ_t, **kwargs)``, record the σ it used, and
        return its result.

        1. The budget is checked first (``BudgetExceededError``: nothing run or recorded).
        2. ``update_fn`` runs with ``noise_multiplier=σ_t``, a float32 scalar array rounded
           up (so a jitted ``update_fn`` does not recompile when ``σ_t`` changes, and the noise
           is never below the σ accounted). Forward it to ``tx.update(...,
           noise_multiplier=...)``.
        3. The result must contain the *new* optimizer state (e.g. ``(params, opt_state)``):
           every :class:`~adaclip_jax.AdaClipState` in it is found by tree traversal, and the
           smallest ``last_noise_multiplier`` among them is the σ used. The accountant records
           ``(q, σ used)`` (the planned ``σ_t`` itself when the two agree up to float32
           rounding). Reading it waits for the step to finish. With ``bands > 1`` only the first
           step of each cycle is checked and recorded, at ``(p = b·q, σ)``; the σ used is
           checked at every step.

        A state in the step's input whose noise has another number of bands than the tracker
        raises ``InvalidHyperparameterError`` before anything runs; one in the result is
        recorded (one composition at rate ``min(1, b_max·q)``) and then raised.

        Errors, all raised *after* the step is recorded (its release may have left; with
        ``bands > 1`` a step inside a cycle is then recorded as one more composition):

        - σ used below the planned ``σ_t`` (e.g. ``update_fn`` did not forward
          ``noise_multiplier`` and the transformation used its own σ): the σ used is recorded
          (even past the budget: it happened), then ``InvalidHyperparameterError`` names both
          values. A σ used above ``σ_t`` is recorded as such, without an error.
        - an invalid σ used (negative, NaN, infinite; the transformation then released NaN):
          ``σ_t`` is recorded, then ``InvalidHyperparameterError``.
        - no ``AdaClipState`` in the result: ``σ_t`` is recorded, then
          ``InvalidHyperparameterError`` asking ``update_fn`` to return the new opt_state.
        - ``update_fn`` raises: ``σ_t`` is recorded (conservatively: the tracker cannot know
          whether the step released anything before it failed), and the exception propagates.

        Every record is made before this method returns or raises, so with an accountant that
        writes a crash-safe ledger (``Accountant(..., ledger=path)``) the step is on disk
        (fsynced) before its result reaches the caller; if the ledger cannot be written, the
        ledger's error propagates and the result is not returned.
        """
        found = self._check_bands(_find_states((args, kwargs)))
        if found is not None:
            raise self._bands_error(found, "the step's input")  # nothing run or recorded
        sigma = self.check_budget()
        _warn_on_replayed_keys((args, kwargs))
        try:
            result = update_fn(*args, noise_multiplier=_float32_at_least(sigma), **kwargs)
        except BaseException:
            self._record(sigma, always=True)
            raise
        found = self._check_bands(_find_states(result))
        if found is not None:
            # the release used noise of another number of bands: one composition for this step
            # at the rate of the larger b (conservative for either), then the error
            self._record(sigma, always=True, rate=min(1.0, max(found, self.bands) * self.sample_rate))
            raise self._bands_error(found, "update_fn's result")
        used = _sigmas_used(result)
        if not used:
            self._record(sigma, always=True)
            raise InvalidHyperparameterError(
                f"step {self._steps - 1}: the result of update_fn contains no AdaClipState, so "
                "the noise multiplier it used cannot be checked; return the new opt_state from "
                "update_fn (e.g. `return params, opt_state`). The step was recorded with the "
                f"planned noise_multiplier={sigma!r}"
            )
        low = min(used)
        if not math.isfinite(low) or low < 0:
            self._record(sigma, always=True)
            raise InvalidHyperparameterError(
                f"step {self._steps - 1}: the transformation used noise_multiplier={low!r} "
                "(invalid: its release is NaN); forward the tracker's noise_multiplier to "
                f"tx.update. The step was recorded with the planned noise_multiplier={sigma!r}"
            )
        if low < _float32_at_most(sigma):
            self._record(low, always=True)
            raise InvalidHyperparameterError(
                f"step {self._steps - 1}: the transformation used noise_multiplier={low!r}, below "
                f"the tracker's planned noise_multiplier={sigma!r}; the step was recorded with "
                f"{low!r}. Forward the keyword: tx.update(..., noise_multiplier=noise_multiplier)"
            )
        self._record(sigma if low <= float(_float32_at_least(sigma)) else low)
        return result

    def _record(self, sigma: float, *, always: bool = False, rate: float | None = None) -> None:
        """One step ran: record ``(rate, σ)`` if it opens a cycle (every step for ``bands = 1``)
        or ``always`` (the error paths: with ``bands > 1`` a step inside a cycle that failed
        or used another σ is recorded as one more composition, conservatively), also past the
        budget (it already happened): :func:`adaclip.accounting.keeper.record`."""
        rate = self._rate if rate is None else rate
        _keeper.record(self.accountant, sigma, rate, records=always or self.records_now())
        self._steps += 1

    def epsilon(self, delta: float) -> float:
        """ε(δ) spent so far."""
        return self.accountant.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "bands": self.bands, "accountant": self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, ignore_ledger: bool = False) -> None:
        """Restore :meth:`state_dict`. With ``bands > 1`` the next step opens a new cycle (it is
        recorded whatever its index: conservative, see the class docstring).

        The accountant restores its part (:meth:`adaclip.accounting.Accountant.load_state_dict`)
        before the tracker changes: a checkpoint of a run that kept a crash-safe ledger is
        restored only with that ledger (its releases after the checkpoint are recorded there
        and nowhere else), so an accountant without a ledger refuses it and the tracker is
        unchanged. ``ignore_ledger=True`` restores it anyway, for a run whose ledger is lost for
        good: **ε then under-counts** by every release made after the checkpoint (a
        ``UserWarning`` says so)."""
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InvalidHyperparameterError(f"state['steps'] must be an int >= 0, got {steps!r}")
        if state.get("bands", 1) != self.bands:
            raise InvalidHyperparameterError(
                f"the saved tracker accounted for {state.get('bands', 1)} band(s), this one for {self.bands}"
            )
        before = getattr(self.accountant, "mechanism", None)
        if ignore_ledger:  # (an accountant-like object need not know the keyword)
            self.accountant.load_state_dict(state["accountant"], ignore_ledger=True)
        else:
            self.accountant.load_state_dict(state["accountant"])
        warn_if_mechanism_adopted(before, getattr(self.accountant, "mechanism", None))
        self._steps = steps
        self._cycle.restart(steps)
