"""A crash-safe privacy ledger: every step on disk before it returns; an older checkpoint never lowers ε."""
import os
import tempfile

from adaclip.accounting import Accountant
from adaclip.errors import InvalidHyperparameterError

run_dir = tempfile.mkdtemp()
ledger = os.path.join(run_dir, "privacy.ledger")  # one per run, next to the checkpoints
checkpoint = os.path.join(run_dir, "accountant.json")

# Train: each step is appended to the ledger and fsynced before step() returns.
acc = Accountant(target_epsilon=8.0, delta=1e-5, ledger=ledger)
for t in range(100):
    acc.step(noise_multiplier=1.0, sample_rate=0.01)
    if t == 49:
        acc.save(checkpoint)  # the checkpoint names the ledger's run_id
spent = acc.epsilon()
acc.close()  # (or the process dies here: the 50 steps after the checkpoint are on the ledger)

# A restart that forgets ledger= is refused: the checkpoint alone counts only its 50 steps.
try:
    Accountant.load(checkpoint)
except InvalidHyperparameterError as err:
    assert f"ledger={ledger!r}" in str(err)  # the message says which ledger to pass
else:
    raise AssertionError("a ledger run's checkpoint was restored without its ledger")

# Resume from the older checkpoint: the ledger's history wins, so ε is not lowered.
resumed = Accountant.load(checkpoint, ledger=ledger)
assert resumed.steps == 100 and resumed.epsilon() == spent
print(f"resumed at {resumed.steps} steps, epsilon = {resumed.epsilon():.3f}")

# A release that may fail: log it first, record it in memory once it has succeeded.
resumed.write_ahead(noise_multiplier=1.0, sample_rate=0.01)  # checks the budget, appends, fsyncs
# ... compute and publish the release here ...
resumed.step(noise_multiplier=1.0, sample_rate=0.01, logged=True)  # memory only: already logged
assert resumed.ledger.steps == resumed.steps == 101
resumed.close()
