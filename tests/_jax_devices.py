"""Run a JAX script in a subprocess with forced CPU devices (``XLA_FLAGS`` must be set before
jax is imported, so multi-device tests cannot run in the test process itself)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_on_cpu_devices(script: str, marker: str, *, devices: int = 4, timeout: int = 300) -> None:
    """Run ``script`` with ``devices`` forced CPU devices; assert it exits 0 and prints ``marker``."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout, proc.stdout
