"""Round-three tasks of the utility benchmark: long runs of round two's language models.

Correlated noise and averaging pay on long runs (many steps); round two's language tasks ran
200–312 steps. These are the same data, models and validation splits with more steps:

- ``transformer-lm-long`` (**a long transformer run**, example level): round two's
  ``transformer-lm`` (2,000 synthetic users' 16,000 sentences of 12 tokens, the one-block
  causal transformer, d = 15,592), B̄ = 256 sentences, 25 epochs: 62 steps an epoch,
  1,550 steps (1,250 on the tuning split).
- ``lstm-users-long`` (**a long user-level run**): round two's ``lstm-users-many`` (8,000
  users with 8 sentences each, the tied LSTM), the unit a user, B̄ = 100 users, 12 epochs:
  80 steps an epoch, 960 steps (768 on the tuning split). Half round two's users per step,
  so one step costs about half as much; twice the steps per epoch.

The learning-rate grids are the base task's (:data:`BASE`), so every method keeps round
two's budget of 2 learning rates × C ∈ {0.1, 1}.
"""

from __future__ import annotations

import dataclasses

from tasks_round2 import load_round2_task
from utility_tasks import Task

#: each round-three task and the round-two task whose data, model and grid it reuses
BASE = {"transformer-lm-long": "transformer-lm", "lstm-users-long": "lstm-users-many"}
ROUND3_TASKS = tuple(BASE)
_OVERRIDES = {
    "transformer-lm-long": {"batch_size": 256.0, "epochs": 25},
    "lstm-users-long": {"batch_size": 100.0, "epochs": 12},
}


def load_round3_task(name: str) -> Task:
    """The round-two task :data:`BASE` names, renamed, with the batch size and epochs above."""
    if name not in BASE:
        raise ValueError(f"unknown round-three task {name!r}; choose from {ROUND3_TASKS}")
    return dataclasses.replace(load_round2_task(BASE[name]), name=name, **_OVERRIDES[name])
