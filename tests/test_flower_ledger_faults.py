"""SIGKILL fault injection of a Flower server strategy with a crash-safe ledger.

A worker process drives ``ServerSideClipping`` (flat clipping, a fake grid, fake replies) with
``Accountant("rdp", ledger=path)`` and prints ``R`` for every round whose aggregate
``aggregate_train`` has *returned* (a release observed from outside). The parent kills it at
random points, restarts it, and checks after every kill that the ledger counts at least every
release seen so far, and at the end that a new accountant on the ledger reports at least the
ε of the observed releases.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from adaclip.accounting import Accountant  # noqa: E402
from adaclip.ledger import LedgerRepairWarning, PrivacyLedger  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])
Q, SIGMA, DELTA = 0.5, 1.0, 1e-5
NODES = 8

# ADACLIP_TEST_UNSAFE_LEDGER=1 breaks the write-ahead on purpose (to show the test can fail):
# write_ahead is a no-op and the round is recorded (appended) only after "R" is printed, after
# a short sleep that makes the window visible. Never set by the tests below.
WORKER = textwrap.dedent(
    """
    import logging, os, sys, time, warnings
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from adaclip import FlatClipping
    from adaclip.accounting import Accountant
    from adaclip.ledger import LedgerRepairWarning
    from adaclip_flower import ServerSideClipping

    ledger, target = sys.argv[1], int(sys.argv[2])
    q, sigma, nodes = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    unsafe = os.environ.get("ADACLIP_TEST_UNSAFE_LEDGER") == "1"
    logging.getLogger("flwr").setLevel(logging.WARNING)  # no per-round log lines
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # messages need a run
    SHAPES = {"w": (3, 2), "b": (4,)}

    class FakeGrid:
        def get_node_ids(self):
            return list(range(101, 101 + nodes))

    def replies(msgs, rnd):
        out = []
        for m in msgs:
            rng = np.random.default_rng((m.metadata.dst_node_id, rnd))
            arrays = {k: Array((a.numpy() + rng.standard_normal(a.numpy().shape)).astype(np.float32))
                      for k, a in m.content["arrays"].items()}
            content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 5})})
            out.append(Message(content=content, reply_to=m))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerRepairWarning)  # a torn tail from the last kill
        acc = Accountant("rdp", ledger=ledger)
    deferred = []
    if unsafe:
        record = acc.record_released
        acc.write_ahead = lambda **kw: None
        acc.record_released = lambda **kw: deferred.append(kw)
    st = ServerSideClipping(FedAvg(), clipping=FlatClipping(max_grad_norm=1.0), noise_multiplier=sigma,
                            sample_rate=q, num_users=nodes, delta=1e-5, seed=None, accountant=acc)
    grid = FakeGrid()
    arrays = ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})
    rnd = acc.steps
    print("START", acc.steps, flush=True)
    while acc.steps < target:
        rnd += 1
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), grid))
        new, _ = st.aggregate_train(rnd, replies(msgs, rnd))
        print("R", flush=True)  # the released aggregate is out of aggregate_train
        if unsafe:
            time.sleep(0.02)
            for kw in deferred:
                record(**kw)  # logged=True with nothing written ahead: appended only now
            deferred.clear()
        arrays = new
    print("DONE", acc.steps, flush=True)
    """
)


def _ledger_steps(path: Path) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerRepairWarning)
        with PrivacyLedger(path) as book:  # reopening counts (and repairs) a torn tail
            return book.steps


def _kill_and_restart(tmp_path: Path, kills: int, target: int, seed: int, unsafe: bool = False) -> int:
    rng = random.Random(seed)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ledger = tmp_path / "run.ledger"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("ADACLIP_TEST_UNSAFE_LEDGER", None)
    if unsafe:
        env["ADACLIP_TEST_UNSAFE_LEDGER"] = "1"
    released = 0
    for attempt in range(kills + 1):
        out_path = tmp_path / f"out{attempt}.txt"
        with open(out_path, "w") as out:
            proc = subprocess.Popen([sys.executable, str(script), str(ledger), str(target), str(Q), str(SIGMA),
                                     str(NODES)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            try:
                if attempt < kills:
                    deadline = time.time() + 60
                    while "START" not in out_path.read_text() and proc.poll() is None and time.time() < deadline:
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 0.4))
                    proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        text = out_path.read_text()
        assert "START" in text, text[-2000:]
        released += text.count("R\n")
        steps = _ledger_steps(ledger)
        assert steps >= released, (attempt, steps, released, text[-2000:])
        if attempt == kills:
            assert proc.returncode == 0 and "DONE" in text, text[-2000:]
    # every observed release is counted: a new accountant on the ledger reports at least their ε
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerRepairWarning)
        restarted = Accountant("rdp", ledger=ledger)
    try:
        assert restarted.steps >= max(released, target)
        observed = Accountant("rdp")
        observed.step(noise_multiplier=SIGMA, sample_rate=Q, num_steps=released)
        assert restarted.epsilon(DELTA) >= observed.epsilon(DELTA)
    finally:
        restarted.close()
    return released


def test_sigkill_of_the_server_never_under_counts_a_released_round(tmp_path):
    _kill_and_restart(tmp_path, kills=3, target=400, seed=0)


@pytest.mark.slow
def test_sigkill_of_the_server_many_times_never_under_counts(tmp_path):
    _kill_and_restart(tmp_path, kills=20, target=3000, seed=1)
