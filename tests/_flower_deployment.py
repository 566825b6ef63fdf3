"""Start a Flower deployment on loopback (one SuperLink, N SuperNodes), run an app with
``flwr run``, and tear everything down, for tests/test_flower_deployment.py.

Flower 1.41: the SuperLink serves its Fleet, Control and Runtime APIs on one HTTP port; every
SuperNode needs its own ``--port``; ``flwr run <app> <connection> --stream`` blocks until the run
ends and takes the connection from ``$FLWR_HOME/config.toml``; ``flwr ls --run-id`` gives the
final status. Each process gets its own ``FLWR_HOME`` and a temporary ``HOME``, runtime
dependency installation is off (no network), and the apps' code is found on ``PYTHONPATH``.

By default the deployment is secure: TLS on the SuperLink's port with a CA and a server
certificate for 127.0.0.1/localhost made here (``cryptography``, a dependency of ``flwr``), and
SuperNode authentication (``--enable-supernode-auth``; node keys made here and registered with
``flwr supernode register``). Each SuperNode's own Runtime API (its link to the ClientApp
processes it starts) stays plain HTTP on 127.0.0.1.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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



# ---------------------------------------------------------------- TLS and node keys
@dataclass(frozen=True)
class Tls:
    """PEM files of a private CA and of a server certificate it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def _write_private_key(path: Path, key: ec.EllipticCurvePrivateKey, fmt: serialization.PrivateFormat) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    path.chmod(0o600)


def make_tls(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Tls:
    """A CA and a server certificate for ``hosts`` (IP addresses and DNS names in the SAN),
    valid for a day; ECDSA P-256 keys."""
    folder.mkdir(parents=True, exist_ok=True)
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=1)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "adaclip test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    tls = Tls(folder / "ca.crt", folder / "server.pem", folder / "server.key")
    tls.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.server_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private_key(tls.server_key, key, serialization.PrivateFormat.PKCS8)
    return tls


@dataclass(frozen=True)
class NodeKey:
    """A SuperNode's authentication key pair (ECDSA P-384, OpenSSH format, as ``ssh-keygen``
    writes them): the private key stays on the node, the public key is registered."""

    private: Path
    public: Path


def make_node_key(folder: Path, name: str) -> NodeKey:
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    pair = NodeKey(folder / name, folder / f"{name}.pub")
    _write_private_key(pair.private, key, serialization.PrivateFormat.OpenSSH)
    pair.public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    return pair


def https_ok(url: str, ca_cert: Path, timeout: float = 0.5) -> bool:
    """GET ``url`` over TLS, verifying the server against ``ca_cert`` only."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:  # noqa: S310
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


# ---------------------------------------------------------------- deployment
#: SuperNodes that are not let in: one whose key was never registered, one without a key.
INTRUDERS = ("unregistered-key", "no-key")
ACTIVATED = re.compile(r"\[Fleet\.ActivateNode\] Activated node_id=(\d+)")


@dataclass
class DeploymentResult:
    status: str  #: the run's final status (``finished:completed`` on success)
    registered: list[int]  #: node ids returned by ``flwr supernode register`` (empty if insecure)
    activated: list[int]  #: node ids the SuperLink activated before the run (from its log)
    refused: dict[str, tuple[int, str]] = field(default_factory=dict)  #: intruder -> (exit code, log)
    run_log: str = ""  #: what ``flwr run --stream`` printed (the ServerApp's log)
    superlink_log: str = ""


def _flwr_cli_all(commands: list[list[str]], env: dict[str, str], cwd: Path, timeout: float = 60.0) -> list[dict]:
    """Run ``flwr <command> --format json`` for each command, concurrently; return their JSON
    outputs (raises with a failing command's output)."""
    running = [subprocess.Popen(["flwr", *c, "--format", "json"], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True) for c in commands]
    outputs = []
    try:
        for command, p in zip(commands, running):
            stdout, stderr = p.communicate(timeout=timeout)
            try:
                out = json.loads(stdout)
            except json.JSONDecodeError:
                out = None
            if p.returncode != 0 or not isinstance(out, dict) or out.get("success") is False:
                raise RuntimeError(f"flwr {' '.join(command)} failed (exit {p.returncode}):\n{stdout}\n{stderr}")
            outputs.append(out)
    finally:
        for p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def run_app(app: Path, workdir: Path, *, num_nodes: int, run_config: str, pythonpath: list[str],
            secure: bool = True, intruders: tuple[str, ...] = (), timeout: float = 240.0) -> DeploymentResult:
    """Run ``app`` on a fresh loopback deployment of ``num_nodes`` SuperNodes.

    ``secure`` (the default): every connection uses TLS with a CA made here (the SuperLink's
    ``--ssl-*`` files; the SuperNodes' ``--root-certificates``; ``root-certificates`` in the
    CLI's connection), and SuperNode authentication is on: the SuperLink runs with
    ``--enable-supernode-auth``, each node's public key is registered with ``flwr supernode
    register`` and the node signs its requests with the private key
    (``--auth-supernode-private-key``). ``intruders`` (kinds from :data:`INTRUDERS`, secure
    only) start alongside with valid TLS settings but no registered key, and are expected to
    be refused and to exit; their partition ids follow the authorised nodes'. Otherwise
    ``--insecure`` everywhere and nodes register themselves.

    Returns once the run ended; raises with the daemons' log tails on failure."""
    if intruders and not secure:
        raise ValueError("intruders need SuperNode authentication (secure=True)")
    if not set(intruders) <= set(INTRUDERS):
        raise ValueError(f"unknown intruders {intruders!r}")
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

    ports = free_ports(1 + num_nodes + len(intruders))
    link = f"127.0.0.1:{ports[0]}"
    node_ports, intruder_ports = ports[1 : 1 + num_nodes], ports[1 + num_nodes :]
    cli_env = env_for(home / "cli")
    connection = f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{link}"\n'
    if secure:
        pki = workdir / "pki"
        tls = make_tls(pki)
        keys = [make_node_key(pki, f"supernode{i}") for i in range(num_nodes)]
        connection += f"root-certificates = {json.dumps(str(tls.ca_cert))}\n"
        link_flags = ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                      "--ssl-keyfile", str(tls.server_key), "--enable-supernode-auth"]
        node_flags = [["--root-certificates", str(tls.ca_cert), "--auth-supernode-private-key", str(k.private)]
                      for k in keys]
        link_up = lambda: https_ok(f"https://{link}/health", tls.ca_cert)  # noqa: E731
    else:
        connection += "insecure = true\n"
        link_flags = ["--insecure"]
        node_flags = [["--insecure"] for _ in range(num_nodes)]
        link_up = lambda: http_ok(f"http://{link}/health")  # noqa: E731
    (home / "cli" / "config.toml").write_text(connection)

    procs = ProcGroup(workdir)
    expected_to_exit: set[str] = set()

    def failed() -> list[str]:
        return [n for n in procs.dead() if n not in expected_to_exit]

    def supernode(name: str, port: int, partition: int, flags: list[str]) -> None:
        procs.start(name, ["flower-supernode", *flags, "--superlink", link, "--host", "127.0.0.1", "--port", str(port),
                           "--node-config", f"partition-id={partition} num-partitions={num_nodes}",
                           "--max-wait-time", "60"], env_for(home / name))

    try:
        procs.start("superlink", ["flower-superlink", *link_flags, "--host", "127.0.0.1", "--port", str(ports[0]),
                                  "--disable-runtime-dependency-installation"], env_for(home / "superlink"))
        deadline = time.monotonic() + 60
        while not link_up():
            if failed() or time.monotonic() > deadline:
                raise RuntimeError(f"the SuperLink did not come up (dead: {procs.dead()})")
            time.sleep(0.2)

        registered: list[int] = []
        if secure:  # the SuperLink's list of authorised nodes, through its Control API
            registered = [int(out["node-id"]) for out in _flwr_cli_all(
                [["supernode", "register", str(k.public), CONNECTION] for k in keys], cli_env, workdir)]
        for i, (port, flags) in enumerate(zip(node_ports, node_flags)):
            supernode(f"supernode{i}", port, i, flags)
        for j, (kind, port) in enumerate(zip(intruders, intruder_ports)):
            flags = ["--root-certificates", str(tls.ca_cert)]
            if kind == "unregistered-key":
                flags += ["--auth-supernode-private-key", str(make_node_key(pki, f"intruder{j}").private)]
            expected_to_exit.add(f"intruder{j}-{kind}")
            supernode(f"intruder{j}-{kind}", port, num_nodes + j, flags)

        # Up: every node activated at the SuperLink (its log), every intruder gone.
        deadline = time.monotonic() + 60
        while True:
            if failed() or time.monotonic() > deadline:
                raise RuntimeError(f"the deployment did not come up (dead: {procs.dead()})")
            activated = [int(i) for i in ACTIVATED.findall(procs.logs["superlink"].read_text(errors="replace"))]
            if (len(activated) >= num_nodes and expected_to_exit <= set(procs.dead())
                    and all(http_ok(f"http://127.0.0.1:{p}/health") for p in node_ports)):
                break
            time.sleep(0.2)
        refused = {n: (procs.procs[n].returncode, procs.logs[n].read_text(errors="replace"))
                   for n in sorted(expected_to_exit)}

        run_log = workdir / "flwr_run.log"
        with open(run_log, "wb") as fh:
            runp = subprocess.Popen(["flwr", "run", str(app), CONNECTION, "--stream", "--run-config", run_config],
                                    env=cli_env, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        procs.procs["flwr-run"], procs.logs["flwr-run"] = runp, run_log
        expected_to_exit.add("flwr-run")
        deadline = time.monotonic() + timeout
        while runp.poll() is None:
            if failed() or time.monotonic() > deadline:
                raise RuntimeError(f"flwr run did not finish (dead: {procs.dead()})")
            time.sleep(0.2)
        found = re.search(r"Successfully started run (\d+)", run_log.read_text(errors="replace"))
        if runp.returncode != 0 or not found:
            raise RuntimeError(f"flwr run failed (exit {runp.returncode})")
        runs = _flwr_cli_all([["ls", CONNECTION, "--run-id", found.group(1)]], cli_env, workdir)[0]["runs"]
        return DeploymentResult(status=runs[0]["status"], registered=registered, activated=activated, refused=refused,
                                run_log=run_log.read_text(errors="replace"),
                                superlink_log=procs.logs["superlink"].read_text(errors="replace"))
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
