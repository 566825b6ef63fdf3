"""User-level DP-FedAvg on Flower: simulated users learn to read digits together, and the
user-level epsilon bounds what the trained model reveals about any one of them.

scikit-learn's digits are dealt out to simulated users (300 by default, about 5 images each;
the Flower App in examples/flower_app, one SuperNode per user). Each round every user joins
independently with probability q (Poisson sampling; 60 users expected by default), trains the
global model locally, and adaclip_flower.ServerSideClipping clips each user's model update,
sums, adds Gaussian noise once, and hands the noisy mean update to FedAvgM, the server
optimizer. The noise multiplier sigma is calibrated so that the planned rounds spend the
target user-level epsilon, and the accountant refuses any round beyond it. The script prints
what the strategy built (the noise, sigma, the clip norm, the sampling and the accounting),
Flower's log of each round, the test accuracy of the global model before and after training,
and the epsilon spent at delta.

At the defaults (300 users, 60 per round, 20 rounds, user-level epsilon = 2 at delta = 1e-5,
sigma = 2.16) the test accuracy goes from 0.11 (the random initial model; chance is 0.1) to
0.88, in 42 s on two idle CPU cores; --quick (100 users, 30 per round, 5 rounds, the same
epsilon, sigma = 1.84) goes to about 0.66-0.72 in 29 s. (On a busy machine, up to twice that:
most of the time is spent starting Flower's and Ray's processes.)

The script runs the app the way Flower 1.41 runs apps, with `flwr run` (run_simulation is
deprecated there): it starts a SuperLink in simulation mode on a free local port, with a Flower
home of its own in a temporary directory, runs the app on it with `flwr run --stream` (one
simulated SuperNode per user), prints the run's log as it comes, and then stops the SuperLink
and everything it started. examples/flower_app/README.md shows how to do the same by hand.

    python examples/flower_dp_fedavg.py --quick               # about 30 s
    python examples/flower_dp_fedavg.py                       # the default setting, about 45 s
    python examples/flower_dp_fedavg.py --epsilon 1           # more noise, lower accuracy
    python examples/flower_dp_fedavg.py --clipping adaclip    # AdaCliP aggregation
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower_app"
sys.path.insert(0, str(APP))
from dp_fedavg.settings import DEFAULTS, NUM_TRAIN, QUICK, SETTINGS  # noqa: E402  (plain Python: no Flower, no torch)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--quick``, one option per key of the app's run config, and the
    launcher's own ``--timeout`` and ``--quiet``."""
    p = argparse.ArgumentParser(
        prog="python examples/flower_dp_fedavg.py", description=__doc__.split("\n\n    python")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The options from --num-users to --seed are the keys of the app's run config "
               "(examples/flower_app/pyproject.toml); --quick sets the first three, and an option given wins.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a small setting that finishes in well under a minute on two CPU cores (the tests run it): "
                        + ", ".join(f"{k} {v:g}" for k, v in QUICK.items()) + ", the same epsilon")
    for key, (default, text) in SETTINGS.items():
        names = [f"--{key}"] + (["--rounds"] if key == "num-server-rounds" else [])
        extra = {"choices": ["flat", "adaclip"]} if key == "clipping" else {"metavar": METAVARS.get(key, "X")}
        quick = f"; --quick: {QUICK[key]:g}" if key in QUICK else ""
        p.add_argument(*names, dest=key, type=type(default), default=None,
                       help=f"{text} (default: {default:g}{quick})" if not isinstance(default, str)
                       else f"{text} (default: {default})", **extra)
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="stop the run after this many seconds (default: 900)")
    p.add_argument("--quiet", action="store_true",
                   help="print only the app's report (what the strategy built, epsilon after each round, the "
                        "summary), not Flower's whole log")
    return p


METAVARS = {"num-users": "U", "users-per-round": "QU", "num-server-rounds": "T", "epsilon": "EPS", "delta": "DELTA",
            "clip-norm": "S", "client-lr": "LR", "epochs": "E", "batch-size": "B", "server-lr": "LR",
            "server-momentum": "BETA", "seed": "SEED"}


def parse_args(argv: Sequence[str] | None = None) -> tuple[dict[str, Any], argparse.Namespace]:
    """The run config (the defaults, then ``--quick``'s, then the options given) and the
    launcher's own options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = dict(DEFAULTS)
    if args.quick:
        cfg.update(QUICK)
    cfg.update({k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None})
    users, per_round = int(cfg["num-users"]), float(cfg["users-per-round"])
    if not 1 <= users <= NUM_TRAIN:
        parser.error(f"--num-users must be between 1 and {NUM_TRAIN} (the training digits), got {users}")
    if not 0 < per_round <= users:
        parser.error(f"--users-per-round must be in (0, num-users], got {per_round:g}")
    return cfg, args


def run_config(cfg: dict[str, Any]) -> str:
    """``--run-config`` of ``flwr run``: TOML values, strings quoted."""
    return " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v!r}" for k, v in cfg.items())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    """A Flower executable of this Python's environment (else the one on PATH)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install Flower (pip install -e '.[torch,flower,examples]')")
    return found


def _environment(flwr_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),  # the apps import adaclip and adaclip_flower from this checkout
        FLWR_HOME=str(flwr_home),
        FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",  # no network
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",  # use this environment's packages
        NO_COLOR="1",
        OMP_NUM_THREADS="1",  # one thread per simulated client: they run side by side
        # Ray warns (FutureWarning) that it will stop overriding CUDA_VISIBLE_DEVICES for actors
        # that ask for no GPU, unless this opts in to that future behaviour now; the clients here
        # use no GPU, so both behaviours are the same for them.
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
    )
    if env.get("PYTHONWARNINGS"):
        # Whoever shows Python's warnings in Flower's processes (PYTHONWARNINGS=default) sees these
        # DeprecationWarnings, which Flower's own imports raise however it is used: typer (Flower's
        # CLI) imports click's get_binary_stream and get_text_stream and declares is_flag options,
        # and pathspec's "gitwildmatch" patterns are what Flower builds its app archive with.
        # Hidden here, for Flower's processes only; any other warning still shows.
        env["PYTHONWARNINGS"] = ",".join([env["PYTHONWARNINGS"], *(
            f"ignore:{message}:DeprecationWarning" for message in (
                "'click.utils.get_binary_stream' is deprecated", "'click.utils.get_text_stream' is deprecated",
                "The 'is_flag' and 'flag_value' parameters are not supported by Typer",
                "GitWildMatchPattern ('gitwildmatch') is deprecated"))])
    return env


def _descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (Linux: from /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2] not in "ZX"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def _stop(superlink: subprocess.Popen) -> None:
    """Stop the SuperLink and everything it started (its SuperExec, the simulation, Ray)."""
    tree = _descendants(superlink.pid)
    for pid in [superlink.pid, *tree]:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (superlink.poll() is None or any(_alive(p) for p in tree)):
        time.sleep(0.1)
    for pid in [superlink.pid, *tree]:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    superlink.wait()


def run_app(cfg: dict[str, Any], *, quiet: bool = False, timeout: float = 900.0) -> str:
    """Run the app with ``flwr run`` on a SuperLink of its own; print and return its log."""
    with tempfile.TemporaryDirectory(prefix="adaclip-flower-") as tmp:
        home = Path(tmp)
        port = _free_port()
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        env = _environment(home)
        superlink_log = home / "superlink.log"
        with open(superlink_log, "wb") as log:
            superlink = subprocess.Popen(
                [_tool("flower-superlink"), "--insecure", "--simulation", "--host", "127.0.0.1", "--port", str(port),
                 "--disable-runtime-dependency-installation"],
                env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        lines: list[str] = []
        try:
            deadline = time.monotonic() + 60
            while not _healthy(port):
                if superlink.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the SuperLink did not start:\n{superlink_log.read_text()[-3000:]}")
                time.sleep(0.2)
            command = [_tool("flwr"), "run", str(APP), "local", "--stream", "--run-config", run_config(cfg),
                       # one simulated SuperNode per user (each simulated client gets Flower's default 2 CPUs)
                       "--federation-config", f"num-supernodes={int(cfg['num-users'])}"]
            with subprocess.Popen(command, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, text=True) as flwr_run:
                watchdog = threading.Timer(timeout, flwr_run.kill)
                watchdog.start()
                try:
                    for raw in flwr_run.stdout:  # type: ignore[union-attr]
                        line = ANSI.sub("", raw.rstrip("\n"))
                        lines.append(line)
                        if not quiet or _reported(line):
                            print(line, flush=True)
                finally:
                    watchdog.cancel()
            if flwr_run.returncode != 0:
                raise SystemExit(f"flwr run exited with {flwr_run.returncode} (killed after {timeout:g} s if negative);"
                                 f" the SuperLink's log:\n{superlink_log.read_text()[-3000:]}")
        finally:
            _stop(superlink)
    return "\n".join(lines)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as response:  # noqa: S310
            return response.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _reported(line: str) -> bool:
    """A line of the app's own report (``--quiet`` keeps these)."""
    return "adaclip_flower" in line or any(key in line for key in ("DP-FedAvg on the digits", "test accuracy before",
                                                                    "user-level epsilon", "Error", "Traceback"))


def main(argv: Sequence[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    t0 = time.monotonic()
    out = run_app(cfg, quiet=args.quiet, timeout=args.timeout)
    if "test accuracy before" not in out:
        raise SystemExit("the run ended without its summary: see the log above")
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
