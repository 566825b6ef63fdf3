"""Shared test configuration: deterministic, deadline-free hypothesis profiles, and the Flower
task identity that tests building Flower messages outside a run need."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def flower_task_identity():
    """Flower builds messages only inside a run; give this process one (restored afterwards)."""
    from flwr.supercore.task_identity import TaskIdentity  # flwr is an optional dependency

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
