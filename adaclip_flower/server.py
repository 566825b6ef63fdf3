"""Flower strategy wrappers for user-level DP-FedAvg with the package's clipping strategies.

:class:`ServerSideClipping` wraps any Flower strategy (``FedAvg``, ``FedAvgM``, ``FedAdam``,
…). Each round it

1. refuses the round before anything is sent if the accountant's budget would be exceeded;
2. Poisson-samples users: every connected node (one node = one user) joins independently
   with probability ``q``;
3. sends each sampled user the global model (and, client-side, the public transform and its
   noise share);
4. clips each user's update ``Δ_k = θ_k − θ`` in the strategy's transformed space, sums,
   adds noise once and applies the estimator (:func:`adaclip_flower.aggregation.aggregate_updates`);
5. hands the released mean update to the wrapped strategy as a single reply carrying
   ``θ + Δ̃``: the wrapped strategy is the **server optimizer** (``FedAvg`` applies it as is,
   ``FedAvgM`` with a server learning rate and momentum, ``FedAdam`` with Adam);
6. records ``(q, σ)`` with the accountant and reports ε in the round's metrics and log.

With ``noise_mechanism="banded"`` (:class:`ServerSideClipping` only) the noise is banded
correlated noise (amplified BandMF, :mod:`adaclip.correlated`): step 2 becomes cyclic Poisson
sampling (each node is assigned once, when first seen, to one of ``b`` groups independently
and uniformly at random; the ``t``-th released round samples only group ``t mod b``, each of
its nodes with probability ``p = b·q``), step 4 adds ``σ·x_t`` with
``x_t = (z_t − Σ_{j≥1} c_j x_{t−j})/c_0`` (the buffers ``x_{t−1}, …`` stay in the strategy),
and step 6 records ``(p, σ)`` once per cycle of ``b`` rounds, at its first round.

:class:`ClientSideClipping` is the same with step 4 on the clients (:func:`adaclip_flower.mods.adaclip_mod`):
each client clips with the public transform and adds ``N(0, σ²/n)``; the server only sums,
makes up the noise of shares that did not arrive, and releases — compatible with secure
aggregation, where the server sees nothing but the sum.

**What leaves the server.** The new global model (a function of the release), ε, and what
the wrapped strategy derives from the release. The clients' own training metrics are *not*
forwarded (they depend on the sampled users' data); client-side evaluation is off unless
``client_evaluation=True`` (its metrics are not private). A client that fails, drops out or
returns NaN or wrong shapes contributes nothing: the round is still released and accounted,
never aborted, so nothing reveals which users were sampled.

**What was built.** When a run starts (:meth:`~_PrivateFedAvgBase.start`, or the first round
when the strategy is driven by hand) the strategy says once, in one record of the Python logger
``adaclip_flower.server`` (:data:`logger`), what it built: the noise (independent, or banded
with ``b``) and who adds it, σ, the clipping and its clip norm, how users are sampled and at
what rate, the planned rounds and the compositions and rate the accountant records for them
(and the ε they spend), the budget, the server optimizer. ``INFO``, or ``WARNING`` when a
setting of the wrapped strategy is set aside on the user's behalf (its ``fraction_train``: users
are Poisson-sampled at ``q`` instead) or when the planned rounds would spend more than the
budget (a round beyond it raises :class:`~adaclip.errors.BudgetExceededError`). Public
hyperparameters only, never the seed. Silence it with
``logging.getLogger("adaclip_flower").setLevel(logging.ERROR)``.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlowerStrategy
from flwr.supercore import log

from adaclip.accounting import Accountant
from adaclip.accounting import keeper as _keeper
from adaclip.correlated.mechanism import NoiseStreamState
from adaclip.errors import InvalidHyperparameterError
from adaclip.strategies import ClipState, FlatClipping, PerLayerClipping, _AffineDefaults, warn_of_noise_drift
from adaclip.strategies import Strategy as ClippingStrategy
from adaclip_flower import aggregation
from adaclip_flower.aggregation import UserLevelMechanism

__all__ = ["ServerSideClipping", "ClientSideClipping", "TRANSFORM_KEY", "CONFIG_KEY", "logger"]

#: The strategies say what they built through this logger, once per strategy (see the module's
#: *What was built*).
logger = logging.getLogger(__name__)

#: Key of the ArrayRecord that carries the public transform to the clients (client-side).
TRANSFORM_KEY = "adaclip.transform"
#: Key of the ConfigRecord that carries the noise share and the clip groups (client-side).
CONFIG_KEY = "adaclip.config"


def _arrays_of(reply: Message, key: str, names: list[str]) -> list[np.ndarray] | None:
    """The reply's arrays in the global model's order, or ``None`` if anything is off."""
    try:
        if reply.has_error():
            return None
        records = reply.content.array_records
        record = records.get(key) if key in records else (next(iter(records.values())) if len(records) == 1 else None)
        if record is None or list(record.keys()) != names:
            return None
        return [np.asarray(a.numpy()) for a in record.values()]
    except Exception:  # noqa: BLE001 - a malformed reply must never abort the round
        return None


def _num_examples(reply: Message, key: str) -> Any:
    try:
        for record in reply.content.metric_records.values():
            if key in record:
                return record[key]
    except Exception:  # noqa: BLE001
        return None
    return None


class _PrivateFedAvgBase(FlowerStrategy):
    """What both wrappers share: sampling, accounting, the server-optimizer hand-off."""

    def __init__(
        self,
        strategy: FlowerStrategy,
        *,
        clipping: ClippingStrategy,
        noise_multiplier: float,
        sample_rate: float,
        num_users: int,
        estimator: str = "fixed",
        weight_cap: float | None = None,
        total_weight: float | None = None,
        min_total_weight: float | None = None,
        accountant: Accountant | None = None,
        delta: float | None = None,
        seed: int | None = None,
        client_evaluation: bool = False,
        weighted_by_key: str = "num-examples",
        noise_mechanism: Any = "independent",
        bands: int | None = None,
    ) -> None:
        if not isinstance(strategy, FlowerStrategy):
            raise InvalidHyperparameterError(f"strategy must be a Flower Strategy, got {strategy!r}")
        noise = aggregation.make_noise_mechanism(noise_mechanism, bands)
        self._refuse_noise_mechanism(noise)
        self.mechanism = UserLevelMechanism(
            clipping=clipping,
            noise_multiplier=noise_multiplier,
            sample_rate=sample_rate,
            num_users=num_users,
            estimator=estimator,
            weight_cap=weight_cap,
            total_weight=total_weight,
            min_total_weight=min_total_weight,
            noise_mechanism=noise,
        )
        if accountant is not None and not isinstance(accountant, Accountant):
            raise InvalidHyperparameterError(f"accountant must be an adaclip Accountant, got {accountant!r}")
        self.accountant = accountant if accountant is not None else Accountant()
        report_delta = delta if delta is not None else self.accountant.delta
        if report_delta is None:
            raise InvalidHyperparameterError("say which delta to report epsilon at: delta=..., or an accountant with a budget")
        if not 0.0 < float(report_delta) < 1.0:
            raise InvalidHyperparameterError(f"delta must be in (0, 1), got {report_delta!r}")
        self.delta = float(report_delta)
        self.strategy = strategy
        self.client_evaluation = bool(client_evaluation)
        self.weighted_by_key = getattr(strategy, "weighted_by_key", weighted_by_key)
        self._array_key = getattr(strategy, "arrayrecord_key", "arrays")
        self._config_key = getattr(strategy, "configrecord_key", "config")
        self._sampler = aggregation.noise_generator(seed)
        self._noise = aggregation.noise_generator(None if seed is None else seed + 1)
        self.clip_state: ClipState | None = None
        self._pending: dict[int, dict[str, Any]] = {}
        # Banded noise. Secret, like the generators' states, and never sent or logged: the
        # group of each node (fixed for the life of this strategy), and the noise buffers.
        self._groups: dict[Any, int] = {}
        self._stream: NoiseStreamState | None = (
            None if self.mechanism.noise_mechanism is None else self.mechanism.noise_mechanism.init()
        )
        self._stream_next: NoiseStreamState | None = None
        #: Rounds released by this strategy: the place ``t`` of the next round in the cycle.
        self.rounds_released = 0
        #: Whether the sampling and the noise were seeded (``seed=``: experiments only).
        self.seeded = seed is not None
        #: The rounds the current :meth:`start` plans (``None`` until a run is started with it).
        self.planned_rounds: int | None = None
        self._planned_from = 0
        self._announced = False

    def _refuse_noise_mechanism(self, noise: Any) -> None:
        """Subclasses refuse a noise mechanism they cannot run (before anything is built)."""

    # ------------------------------------------------------------------ reporting

    @property
    def epsilon(self) -> float:
        """ε(δ) of the rounds released so far (user level)."""
        return self.accountant.epsilon(self.delta) if self.accountant.steps else 0.0

    @property
    def noise_multiplier(self) -> float:
        """σ, per round, in units of the sensitivity."""
        return self.mechanism.noise_multiplier

    @property
    def sample_rate(self) -> float:
        """``q``: the probability that a user joins a round."""
        return self.mechanism.sample_rate

    @property
    def num_users(self) -> int:
        """``U``: the population that can be sampled."""
        return int(self.mechanism.num_users)

    @property
    def noise_mechanism(self) -> str:
        """``"independent"`` (fresh noise every round) or ``"banded"`` (banded correlated noise)."""
        return "independent" if self.mechanism.noise_mechanism is None else "banded"

    @property
    def bands(self) -> int:
        """``b``: 1 with independent noise, the number of bands (and sampling groups) with banded noise."""
        return int(self.mechanism.bands)

    @property
    def accounted_sample_rate(self) -> float:
        """The rate the accountant records: ``q``, or ``p = b·q`` with banded noise."""
        return float(self.mechanism.accounted_sample_rate)

    @property
    def clip_norm(self) -> float | None:
        """``S``, the norm each user's update is clipped to, for flat and per-layer clipping
        (their ``max_grad_norm``); ``None`` for strategies whose clipping adapts (AdaCliP's
        scale, the quantile rule, automatic clipping)."""
        clipping = self.mechanism.clipping
        return float(clipping.max_grad_norm) if isinstance(clipping, (FlatClipping, PerLayerClipping)) else None

    @property
    def planned_compositions(self) -> int | None:
        """The compositions the accountant records for :attr:`planned_rounds` (one per round with
        independent noise, one per cycle of ``b`` rounds with banded noise); ``None`` before a
        run is started with :meth:`start`."""
        if self.planned_rounds is None:
            return None
        m = self.mechanism
        return sum(1 for i in range(self._planned_from, self._planned_from + self.planned_rounds) if m.opens_cycle(i))

    def planned_epsilon(self, delta: float | None = None) -> float | None:
        """ε(δ) at the end of the planned rounds, at ``delta`` (default: the reporting δ): what
        the accountant holds now (earlier runs of a resumed ledger included) plus the
        compositions of the planned rounds not yet released; ``None`` before a run is started
        with :meth:`start`. Composes on a detached copy of the accountant (with PLD a fraction
        of a second)."""
        if self.planned_rounds is None:
            return None
        m = self.mechanism
        ahead = sum(1 for i in range(self.rounds_released, self._planned_from + self.planned_rounds) if m.opens_cycle(i))
        accountant = copy.deepcopy(self.accountant)  # detached: records in memory only
        if ahead:
            accountant.record_released(noise_multiplier=self.noise_multiplier, sample_rate=self.accounted_sample_rate,
                                       num_steps=ahead)
        return float(accountant.epsilon(self.delta if delta is None else delta)) if accountant.steps else 0.0

    def _explain_refusal(self) -> str:
        """The strategy's side of a budget refusal: the rate it accounts and the rounds released
        (public quantities only)."""
        m = self.mechanism
        rate = _keeper.accounted_rate_words(m.sample_rate, m.bands, m.accounted_sample_rate)
        return f"; this strategy accounts each composition at {rate} and has released {self.rounds_released} round(s)"

    def _noise_words(self) -> str:
        if self.mechanism.noise_mechanism is None:
            return "independent noise (fresh every round), added once by the server"
        return f"banded correlated noise, b = {self.bands} (amplified BandMF), added once by the server"

    def announce(self) -> None:
        """Log what this strategy built, once (see the module's *What was built*). Called by
        :meth:`start` and, for a strategy driven by hand, by the first :meth:`configure_train`."""
        if self._announced:
            return
        self._announced = True
        if not logger.isEnabledFor(logging.WARNING):
            return
        m = self.mechanism
        acc = self.accountant
        warnings: list[str] = []
        fraction = getattr(self.strategy, "fraction_train", 1.0)
        if isinstance(fraction, (int, float)) and fraction != 1.0:
            warnings.append(f"the wrapped {type(self.strategy).__name__}'s fraction_train={fraction:g} is not used: "
                            f"users are Poisson-sampled at q = {m.sample_rate:.4g} instead")  # fmt: skip
        planned_epsilon = None
        if self.planned_rounds is not None and (acc.target_epsilon is not None or logger.isEnabledFor(INFO)):
            planned_epsilon = self.planned_epsilon()
            at_budget = planned_epsilon if acc.delta in (None, self.delta) else self.planned_epsilon(acc.delta)
            if acc.target_epsilon is not None and at_budget > acc.target_epsilon:
                warnings.append(f"the {self.planned_rounds} planned rounds would spend epsilon = {at_budget:.4g} at "
                                f"delta = {acc.delta:g}, "
                                f"more than the budget of {acc.target_epsilon:g}: the first round beyond it raises "
                                "BudgetExceededError before anything is sent")  # fmt: skip
        level = logging.WARNING if warnings else INFO
        if not logger.isEnabledFor(level):
            return
        clip = self.clip_norm
        parts = [
            self._noise_words(),
            f"sigma = {m.noise_multiplier:.4g}" + (" (no privacy)" if m.noise_multiplier == 0 else ""),
            f"clipping {m.clipping!r}, " + (f"clip norm {clip:g} per user update" if clip is not None
                                           else "clip norm adapted by the strategy"),
        ]
        if m.bands == 1:
            parts.append(f"users Poisson-sampled every round at q = {m.sample_rate:.4g} of {m.num_users} "
                         f"({m.sample_rate * m.num_users:.4g} expected)")  # fmt: skip
        else:
            parts.append(f"users cyclically Poisson-sampled: {m.bands} groups drawn at random, round t samples group "
                         f"t mod {m.bands} at p = b*q = {m.accounted_sample_rate:.4g} (q = {m.sample_rate:.4g} of "
                         f"{m.num_users}, {m.sample_rate * m.num_users:.4g} expected per round)")  # fmt: skip
        parts.append(f"estimator {m.estimator} (denominator {m.expected_batch_size:.4g})")
        per = "every round" if m.bands == 1 else f"per cycle of {m.bands} rounds"
        if self.planned_rounds is None:
            parts.append(f"accounted as one composition {per} at rate {m.accounted_sample_rate:.4g}")
        else:
            spent = "" if planned_epsilon is None else (
                f"; epsilon = {planned_epsilon:.4g} at delta = {self.delta:g} after them ({acc.mechanism})")
            parts.append(f"{self.planned_rounds} planned rounds, accounted as {self.planned_compositions} compositions "
                         f"at rate {m.accounted_sample_rate:.4g}{spent}")  # fmt: skip
        if acc.steps:
            parts.append(f"{acc.steps} compositions already recorded by the accountant")
        if acc.target_epsilon is not None:
            parts.append(f"budget epsilon = {acc.target_epsilon:g} at delta = {acc.delta:g}")
        else:
            parts.append(f"no budget (epsilon reported at delta = {self.delta:g})")
        parts.append(f"server optimizer {type(self.strategy).__name__}")
        parts.append("federated evaluation on (its metrics are not private)" if self.client_evaluation
                     else "federated evaluation off")
        if self.seeded:
            parts.append("sampling and noise seeded (experiments only: a known seed predicts the noise)")
        logger.log(level, "%s built user-level DP-FedAvg: %s", type(self).__name__, "; ".join(parts + warnings))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's :meth:`flwr.serverapp.strategy.Strategy.start`, after recording the planned
        rounds (:attr:`planned_rounds`) and saying what this strategy built (:meth:`announce`)."""
        self.planned_rounds = int(num_rounds)
        self._planned_from = self.rounds_released
        self.announce()
        return super().start(grid, initial_arrays, num_rounds=num_rounds, timeout=timeout, train_config=train_config,
                             evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def _metrics(self) -> MetricRecord:
        m = self.mechanism
        if m.noise_mechanism is None:
            return MetricRecord(
                {
                    "epsilon": float(self.epsilon),
                    "delta": self.delta,
                    "noise-multiplier": m.noise_multiplier,
                    "sample-rate": m.sample_rate,
                    "rounds-released": int(self.accountant.steps),
                }
            )
        return MetricRecord(
            {
                "epsilon": float(self.epsilon),
                "delta": self.delta,
                "noise-multiplier": m.noise_multiplier,
                "sample-rate": m.sample_rate,
                "rounds-released": int(self.rounds_released),
                "bands": int(m.bands),
                "accounted-sample-rate": float(m.accounted_sample_rate),
                "compositions": int(self.accountant.steps),
            }
        )

    def summary(self) -> None:
        m = self.mechanism
        log(INFO, "\t├──> User-level DP (%s):", type(self).__name__)
        log(INFO, "\t│\t├── clipping: %r", m.clipping)
        log(INFO, "\t│\t├── noise multiplier σ = %s, sample rate q = %s of %d users", m.noise_multiplier, m.sample_rate, m.num_users)
        log(INFO, "\t│\t├── estimator: %s", m.estimator)
        if m.noise_mechanism is None:
            log(INFO, "\t│\t└── noise: independent (accounted at q every round)")
        else:
            log(INFO, "\t│\t└── noise: banded, b = %d (cyclic Poisson sampling; accounted at p = b·q = %s per cycle of b rounds)",
                m.bands, m.accounted_sample_rate)
        self.strategy.summary()

    # ------------------------------------------------------------------ training

    def _sample(self, grid: Grid, index: int) -> list[int]:
        """Poisson sampling of the connected nodes at ``q`` (independent noise); with banded
        noise cyclic Poisson sampling: a node seen for the first time is assigned a group by an
        independent uniform draw, and round ``index`` takes only the nodes of group
        ``index mod b``, each with probability ``p = b·q``."""
        m = self.mechanism
        nodes = sorted(grid.get_node_ids())
        if m.bands == 1:  # no group drawn: b = 1 is plain Poisson sampling, draw for draw
            coins = self._sampler.random(len(nodes)) < m.accounted_sample_rate
            return [node for node, joined in zip(nodes, coins, strict=True) if joined]
        new = [node for node in nodes if node not in self._groups]
        for node, group in zip(new, self._sampler.integers(0, m.bands, size=len(new)), strict=True):
            self._groups[node] = int(group)
        coins = self._sampler.random(len(nodes)) < m.accounted_sample_rate
        group = index % m.bands
        return [node for node, joined in zip(nodes, coins, strict=True) if joined and self._groups[node] == group]

    def _content(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> RecordDict:
        """The wrapped strategy's train content (its config included); its own choice of
        nodes is discarded. Calling it also lets server optimizers remember θ."""
        template = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if template:
            return template[0].content
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        return RecordDict({self._array_key: arrays, self._config_key: config})

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Refuse the round if the budget would be exceeded (with banded noise: a round that
        opens a cycle); Poisson-sample the users (cyclically with banded noise)."""
        self.announce()
        m = self.mechanism
        index = self.rounds_released
        _keeper.refuse(self.accountant, m.noise_multiplier, m.accounted_sample_rate, step=server_round,
                       records=m.opens_cycle(index), explain=self._explain_refusal, unit="round")  # fmt: skip
        names = list(arrays.keys())
        current = [np.asarray(a.numpy()) for a in arrays.values()]
        if not all(np.issubdtype(c.dtype, np.floating) for c in current):
            raise InvalidHyperparameterError("every array of the global model must be floating point")
        if self.clip_state is None:
            self.clip_state = m.clipping.init([c.astype(np.float64) for c in current])
            # κ of the released mean (where the clip level follows the noise: AdaCliP's coupled
            # scale): d coordinates, σ on a sum divided by B̄ = qW (or qW_min)
            warn_of_noise_drift(m.clipping, sum(c.size for c in current), m.release_noise_multiplier,
                                m.expected_batch_size)
        content = self._content(server_round, arrays, config, grid)  # waits for the wrapped strategy's minimum of nodes
        sampled = self._sample(grid, index)
        content = self._client_content(content, len(sampled), current)
        self._pending[server_round] = {
            "names": names, "current": current, "num_sampled": len(sampled), "template": content, "index": index,
        }
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node) for node in sampled]

    def _client_content(self, content: RecordDict, num_sampled: int, current: list[np.ndarray]) -> RecordDict:
        return content

    def _release(self, pending: dict[str, Any], replies: list[Message]) -> list[np.ndarray]:
        raise NotImplementedError

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Release one round (always, whatever the replies), account it, and step the server
        optimizer with the released mean update."""
        if server_round not in self._pending:
            raise InvalidHyperparameterError(f"round {server_round} was not configured by this strategy")
        m = self.mechanism
        index = self._pending[server_round]["index"]
        if m.bands > 1 and index != self.rounds_released:
            del self._pending[server_round]  # its group's turn has passed: it can never be released
            raise InvalidHyperparameterError(
                f"round {server_round} sampled the group of place {index} of the run, but "
                f"{self.rounds_released - index} round(s) have been released since: with banded noise each "
                "round must be aggregated before the next one is configured; nothing was released"
            )
        opens = m.opens_cycle(index)
        rate = m.accounted_sample_rate
        # The budget again (rounds configured before this one was released may have spent it),
        # then write ahead: the round (with banded noise: the cycle it opens) is on the
        # accountant's ledger (if it has one; fsynced) before its noisy aggregate exists, so a
        # crash at any later point still counts it. If the release fails, the ledger counts one
        # round more than memory (conservative). The protocol: adaclip.accounting.keeper.
        logged = _keeper.admit(self.accountant, m.noise_multiplier, rate, step=server_round, records=opens,
                               explain=self._explain_refusal, unit="round")  # fmt: skip
        pending = self._pending.pop(server_round)
        self._stream_next = None
        mean_update = self._release(pending, list(replies))
        _keeper.record(self.accountant, m.noise_multiplier, rate, records=opens, logged=logged)
        if self._stream_next is not None:  # the round's noise joins the buffers
            self._stream, self._stream_next = self._stream_next, None
        self.rounds_released += 1
        proposal = {
            name: Array(np.asarray(c + u.astype(c.dtype, copy=False)))
            for name, c, u in zip(pending["names"], pending["current"], mean_update, strict=True)
        }
        instruction = Message(content=pending["template"], message_type=MessageType.TRAIN, dst_node_id=0)
        released = Message(
            content=RecordDict(
                {self._array_key: ArrayRecord(proposal), "metrics": MetricRecord({self.weighted_by_key: 1})}
            ),
            reply_to=instruction,
        )
        new_arrays, _ = self.strategy.aggregate_train(server_round, [released])
        metrics = self._metrics()
        if m.noise_mechanism is None:
            log(INFO, "aggregate_train: user-level epsilon = %.4f at delta = %g after %d rounds",
                metrics["epsilon"], self.delta, self.accountant.steps)
        else:
            log(INFO, "aggregate_train: user-level epsilon = %.4f at delta = %g after %d rounds "
                "(%d compositions at p = %g)", metrics["epsilon"], self.delta, self.rounds_released,
                self.accountant.steps, rate)
        return new_arrays, metrics

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation only with ``client_evaluation=True`` (its metrics are not private)."""
        if not self.client_evaluation:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if not self.client_evaluation:
            return None
        return self.strategy.aggregate_evaluate(server_round, replies)


class ServerSideClipping(_PrivateFedAvgBase):
    """User-level DP-FedAvg with clipping and noise at the server (central DP).

    Args:
      strategy: the Flower strategy used as server optimizer (``FedAvg()``: apply the mean
        update; ``FedAvgM(server_learning_rate=η, server_momentum=β)``; ``FedAdam(...)``).
        Its sampling settings are ignored: users are Poisson-sampled at ``sample_rate``.
      clipping: an :mod:`adaclip.strategies` strategy, e.g. ``FlatClipping(max_grad_norm=S)``
        or ``AdaptiveClipping(...)``: how each user's update is clipped (its transform is
        learned from released aggregates only).
      noise_multiplier: ``σ`` (per round, in units of the sensitivity).
      sample_rate: ``q``, the probability that a user joins a round.
      num_users: ``U``, the population (the number of nodes that can be sampled).
      estimator, weight_cap, total_weight, min_total_weight: the weighted-average estimator
        (:class:`adaclip_flower.aggregation.UserLevelMechanism`); the default is the fixed
        denominator ``qU`` with unit weights.
      accountant: an :class:`adaclip.accounting.Accountant`; with a budget
        (``target_epsilon``, ``delta``), a round that would exceed it raises
        :class:`adaclip.errors.BudgetExceededError` before anything is sent. Default: a new
        RDP accountant without budget. With a crash-safe ledger
        (``Accountant(..., ledger=path)``) each round is appended to it (fsynced) before its
        aggregate is computed, so a round whose result left is counted after any crash.
      delta: δ at which ε is reported (default: the accountant's).
      seed: seeds the sampling and the noise (experiments only); ``None`` draws them from
        the OS.
      client_evaluation: forward federated evaluation to the wrapped strategy (off: the
        clients' evaluation metrics are not private; evaluate on the server instead).
      noise_mechanism: ``"independent"`` (default: fresh noise every round) or ``"banded"``
        with ``bands=b`` (the truncated square-root coefficients), or an
        :class:`adaclip.correlated.BandedNoise` (e.g. optimised coefficients): banded
        correlated noise (amplified BandMF, the noise of DP-FTRL-style federated training).
        Users are then sampled cyclically — each node is assigned, when first seen, to one of
        ``b`` groups uniformly at random; the ``t``-th round released by this strategy samples
        only group ``t mod b``, each of its nodes with probability ``p = b·q`` (``b·q ≤ 1``) —
        and the accountant records ``(p, σ)`` once per cycle of ``b`` rounds, at its first
        round (the budget is checked and the ledger written ahead then): ``⌈T/b⌉``
        compositions for ``T`` rounds. Calibrate ``σ`` for that. The buffers (the last
        ``b − 1`` noise vectors) and the group of each node live in this object only, as
        secret as the seed; a new strategy object (a restart) starts a new stream, new groups
        and a new cycle. With ``b = 1`` it is the independent noise, draw for draw. Adaptive
        strategies subtract the noise's true variance ``σ²·v_t``.
      bands: ``b`` for ``noise_mechanism="banded"``.

    The round's metrics carry ``epsilon``, ``delta``, ``noise-multiplier``, ``sample-rate`` and
    ``rounds-released``; :attr:`epsilon` reads it at any time. With banded noise
    ``rounds-released`` counts the rounds this strategy released, and the metrics add
    ``bands``, ``accounted-sample-rate`` (``p``) and ``compositions`` (the accountant's steps).
    """

    def _release(self, pending: dict[str, Any], replies: list[Message]) -> list[np.ndarray]:
        m = self.mechanism
        current = pending["current"]
        replied = [_arrays_of(reply, self._array_key, pending["names"]) for reply in replies]
        counts = [_num_examples(reply, self.weighted_by_key) for reply in replies]
        stacked = aggregation.stack_updates(replied, current)  # checks names, shapes, finiteness
        for rows, c in zip(stacked.stacked, current, strict=True):
            rows[stacked.valid] -= c.astype(np.float64)  # Δ_k = θ_k − θ (invalid rows stay 0)
        weights = m.user_weights(counts, len(replied))
        noise = None
        variance = 1.0
        if m.noise_multiplier > 0:
            noise = aggregation.standard_normal_like(current, self._noise, getattr(m.clipping, "num_auxiliary", 0))
            if self._stream is not None:  # banded: x_t from the buffers; kept once the round is released
                noise, variance, self._stream_next = aggregation.correlate_noise(m, self._stream, noise)
        mean_update, self.clip_state = aggregation.aggregate_updates(
            m, self.clip_state, stacked, weights=weights, noise=noise, noise_variance=variance
        )
        return mean_update


def _default_clip_factors(clipping: ClippingStrategy) -> bool:
    method = getattr(type(clipping), "clip_factors", None)
    return method is _AffineDefaults.clip_factors


class ClientSideClipping(_PrivateFedAvgBase):
    """User-level DP-FedAvg with clipping and noise shares on the clients.

    The same arguments as :class:`ServerSideClipping`; the clients' ``ClientApp`` must carry
    :func:`adaclip_flower.mods.adaclip_mod`. Each round the server sends the public transform
    ``(a, b)``, the clip groups and the noise share ``σ/√n`` (``n`` users sampled); each client
    returns ``ω_k·\\bar w_k + (σ/√n)·z_k`` in the transformed space. The server sums them, adds
    ``N(0, σ²(n − m)/n)`` for the ``m`` of ``n`` shares that did not arrive, and releases.
    Supports the fixed denominator and strategies whose clip is ``min(1, r/‖w‖)`` without
    auxiliary sums (flat, per-layer, scaled, AdaCliP and its transform options).

    Trust: the server cannot check the clients' clipping (it sees noisy values); a client
    that clips wrongly or adds too little noise breaks the guarantee for its own data, as with
    any client-side DP.

    Banded correlated noise (``bands > 1``) is refused here: ``x_t`` is computed from the
    earlier rounds' noise ``x_{t−1}, …`` (the buffers), and with client-side shares nobody holds
    that noise — the server sees only the sum of clipped updates and shares, and each round's
    clients hold their own share only (the sampled set changes every round). Use
    :class:`ServerSideClipping` for ``noise_mechanism="banded"``.
    """

    def _noise_words(self) -> str:
        return ("independent noise, in shares sigma/sqrt(n) added by the n sampled clients (the server adds the "
                "shares that do not arrive)")

    def _refuse_noise_mechanism(self, noise: Any) -> None:
        if noise is not None and noise.bands > 1:
            raise InvalidHyperparameterError(
                f"client-side clipping cannot use banded noise ({noise!r}): each round's noise must be "
                "correlated with the earlier rounds' noise, which is kept with whoever drew it, and the "
                "clients each draw a share of it, with no memory of the sum. Use ServerSideClipping(..., "
                "noise_mechanism='banded', bands=b), or noise_mechanism='independent' here"
            )

    def __init__(self, strategy: FlowerStrategy, **kwargs: Any) -> None:
        super().__init__(strategy, **kwargs)
        m = self.mechanism
        if m.estimator != "fixed":
            raise InvalidHyperparameterError("client-side clipping supports estimator='fixed' only")
        if getattr(m.clipping, "num_auxiliary", 0) or not _default_clip_factors(m.clipping):
            raise InvalidHyperparameterError(
                f"client-side clipping needs a strategy clipped by min(1, r/‖w‖) without auxiliary sums, got {m.clipping!r}"
            )

    def _client_content(self, content: RecordDict, num_sampled: int, current: list[np.ndarray]) -> RecordDict:
        m = self.mechanism
        num = len(current)
        centre, scale = m.clipping.transform(self.clip_state, num)
        arrays: dict[str, Array] = {}
        for j in range(num):
            arrays[f"scale.{j}"] = Array(np.asarray(scale[j], dtype=np.float64))
            if centre is not None:
                arrays[f"centre.{j}"] = Array(np.asarray(centre[j], dtype=np.float64))
        groups = m.clipping.clip_groups(num)
        config = ConfigRecord(
            {
                "noise-std": aggregation.client_noise_std(m.noise_multiplier, num_sampled) if num_sampled else 0.0,
                "num-tensors": num,
                "has-centre": centre is not None,
                "group-of": [next(g for g, (members, _) in enumerate(groups) if j in members) for j in range(num)],
                "group-radius": [float(r) for _, r in groups],
                "weight-cap": float(m.weight_cap) if m.weight_cap is not None else 0.0,
                "weighted-by-key": self.weighted_by_key,
            }
        )
        out = RecordDict(dict(content.items()))
        out[TRANSFORM_KEY] = ArrayRecord(arrays)
        out[CONFIG_KEY] = config
        return out

    def _release(self, pending: dict[str, Any], replies: list[Message]) -> list[np.ndarray]:
        m = self.mechanism
        current = pending["current"]
        replied = [_arrays_of(reply, self._array_key, pending["names"]) for reply in replies]
        stacked = aggregation.stack_updates(replied, current)  # checks names, shapes, finiteness
        total = [rows[stacked.valid].sum(axis=0) for rows in stacked.stacked]
        received = int(stacked.valid.sum())
        n = pending["num_sampled"]
        received = min(received, n)
        make_up = aggregation.missing_share_noise_multiplier(m.noise_multiplier, n, received)
        noise = aggregation.standard_normal_like(current, self._noise) if make_up > 0 else None
        mean_update, self.clip_state = aggregation.release_client_sums(
            m, self.clip_state, total, make_up_noise=noise, make_up_multiplier=make_up
        )
        return mean_update
