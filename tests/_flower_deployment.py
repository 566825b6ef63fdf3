"""Start a Flower deployment on loopback (one SuperLink, N SuperNodes), run an app with
``flwr run``, and tear everything down, for tests/test_flower_deployment.py.

Flower 1.41: the SuperLink serves its Fleet, Control and Runtime APIs on one HTTP port; every
SuperNode needs its own ``--port``; ``flwr run <app> <connection> --stream`` blocks until the run
ends and takes the connection from ``$FLWR_HOME/config.toml``; ``flwr ls --run-id`` gives the
final status. Each process gets its own ``FLWR_HOME`` and a temporary ``HOME``, runtime
dependency installation is off (no network), and the apps' code is found on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

CONNECTION = "loopback"


def free_ports(n: int) -> list[int]:
    """Return n distinct free TCP ports on 127.0.0.1 (held open simultaneously)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_ok(url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ---------------------------------------------------------------- process tree
def _proc_stat(pid: int) -> tuple[int, int] | None:
    """Return (ppid, starttime) of pid from /proc, or None if gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = data[data.rfind(")") + 2 :].split()
    if rest[0] in ("Z", "X"):  # zombie/dead: nothing left to kill
        return None
    return int(rest[1]), int(rest[19])


def descendants(root_pids: list[int]) -> dict[int, int]:
    """All live descendants of root_pids as {pid: starttime} (Linux /proc)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st:
                children.setdefault(st[0], []).append(int(entry))
                starts[int(entry)] = st[1]
    out: dict[int, int] = {}
    stack = list(root_pids)
    while stack:
        for c in children.get(stack.pop(), []):
            if c not in out:
                out[c] = starts[c]
                stack.append(c)
    return out


class ProcGroup:
    """Start daemons in their own sessions; kill them and all descendants."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        logf = self.logdir / f"{name}.log"
        self.logs[name] = logf
        fh = open(logf, "wb")  # noqa: SIM115 - the child keeps its own handle
        self.procs[name] = subprocess.Popen(
            cmd,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        fh.close()

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def tail(self, name: str, n: int = 30) -> str:
        try:
            lines = self.logs[name].read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop_all(self, grace: float = 5.0) -> None:
        # Snapshot the whole tree first: SuperLink's SuperExec runs in its own
        # session (start_new_session=True inside flwr) and ServerApp/ClientApp
        # processes are grandchildren, so process-group kills alone miss them.
        tree = descendants([p.pid for p in self.procs.values()])
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for pid, st in tree.items():  # SIGTERM the grandchildren directly too
            cur = _proc_stat(pid)
            if cur and cur[1] == st:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        # Children (SuperExec etc.) exit on their own once the parent is gone
        # (parent-pid monitor, 0.2 s polling); give them until the deadline.
        while time.monotonic() < deadline and any(
            _proc_stat(pid) and _proc_stat(pid)[1] == st for pid, st in tree.items()
        ):
            time.sleep(0.1)
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for pid, st in tree.items():
            cur = _proc_stat(pid)
            if cur and cur[1] == st:  # same process (guards against pid reuse)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass



def run_app(app: Path, workdir: Path, *, num_nodes: int, run_config: str, pythonpath: list[str],
            timeout: float = 240.0) -> str:
    """Run ``app`` on a fresh loopback deployment; returns the run's final status
    (``finished:completed`` on success). Raises with the daemons' log tails on failure."""
    home = workdir / "home"
    home.mkdir(parents=True)
    base = dict(os.environ)
    base.update(
        HOME=str(home),
        PYTHONPATH=os.pathsep.join(pythonpath + ([base["PYTHONPATH"]] if base.get("PYTHONPATH") else [])),
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.1",
        NO_COLOR="1",
        OMP_NUM_THREADS="1",
    )

    def env_for(flwr_home: Path) -> dict[str, str]:
        flwr_home.mkdir(parents=True, exist_ok=True)
        return dict(base, FLWR_HOME=str(flwr_home))

    ports = free_ports(1 + num_nodes)
    link = f"127.0.0.1:{ports[0]}"
    cli_env = env_for(home / "cli")
    (home / "cli" / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{link}"\ninsecure = true\n'
    )
    procs = ProcGroup(workdir)
    try:
        procs.start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(ports[0]),
                                  "--disable-runtime-dependency-installation"], env_for(home / "superlink"))
        for i, port in enumerate(ports[1:]):
            procs.start(f"supernode{i}", ["flower-supernode", "--insecure", "--superlink", link, "--host", "127.0.0.1",
                                          "--port", str(port), "--node-config",
                                          f"partition-id={i} num-partitions={num_nodes}", "--max-wait-time", "60"],
                        env_for(home / f"supernode{i}"))
        deadline = time.monotonic() + 60
        while not all(http_ok(f"http://127.0.0.1:{p}/health") for p in ports):
            if procs.dead() or time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not come up (dead: {procs.dead()})")
            time.sleep(0.2)
        run_log = workdir / "flwr_run.log"
        with open(run_log, "wb") as fh:
            runp = subprocess.Popen(["flwr", "run", str(app), CONNECTION, "--stream", "--run-config", run_config],
                                    env=cli_env, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        procs.procs["flwr-run"], procs.logs["flwr-run"] = runp, run_log
        deadline = time.monotonic() + timeout
        while runp.poll() is None:
            if [n for n in procs.dead() if n != "flwr-run"] or time.monotonic() > deadline:
                raise RuntimeError(f"flwr run did not finish (dead: {procs.dead()})")
            time.sleep(0.2)
        found = re.search(r"Successfully started run (\d+)", run_log.read_text(errors="replace"))
        if runp.returncode != 0 or not found:
            raise RuntimeError(f"flwr run failed (exit {runp.returncode})")
        listing = subprocess.run(["flwr", "ls", CONNECTION, "--run-id", found.group(1), "--format", "json"],
                                 env=cli_env, cwd=workdir, capture_output=True, text=True, timeout=60, check=False)
        return json.loads(listing.stdout)["runs"][0]["status"]
    except BaseException as exc:
        tails = "\n".join(f"----- {name} -----\n{procs.tail(name)}" for name in procs.logs)
        raise RuntimeError(f"{exc!r}\n{tails}") from exc
    finally:
        procs.stop_all()


def run_app_in_simulation(app: Path, workdir: Path, *, num_supernodes: int, run_config: str,
                          pythonpath: list[str], timeout: float = 300.0) -> str:
    """``flwr run`` of ``app`` on a simulation connection (``options.num-supernodes``); returns
    what the run printed. ``flwr run`` starts a local SuperLink in simulation mode that outlives
    it: it and its children are stopped here (they are found by this run's ``FLWR_HOME``)."""
    home = workdir / "home"
    flwr_home = home / "flwr"
    flwr_home.mkdir(parents=True)
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\noptions.num-supernodes = {int(num_supernodes)}\n'
    )
    env = dict(os.environ)
    env.update(
        HOME=str(home), FLWR_HOME=str(flwr_home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", PYTHONDONTWRITEBYTECODE="1", NO_COLOR="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(pythonpath + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    )
    try:
        done = subprocess.run(["flwr", "run", str(app), "sim", "--stream", "--run-config", run_config], env=env,
                              cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False)
        return done.stdout + done.stderr
    finally:
        _stop_local_superlink(flwr_home)


def _stop_local_superlink(flwr_home: Path) -> None:
    marker = str(flwr_home)
    roots = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "flower-superlink" in cmdline and marker in cmdline:
                roots.append(int(entry))
    tree = descendants(roots)
    for pid in roots + list(tree):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_proc_stat(p) for p in roots + list(tree)):
        time.sleep(0.1)
    for pid in roots + list(tree):
        if _proc_stat(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
