"""Start, stop and inspect one local Kubernetes control plane with fake GPU nodes.

Called by ``rolloutfleet sandbox up|down|status`` (:mod:`rolloutfleet.sandbox.commands`), by the
session fixture in ``tests/integration/conftest.py`` and by ``bench/``. A :class:`Cluster` owns one
cluster directory::

    <dir>/pki/           CA, apiserver serving pair, service-account keys, token file (certs.py)
    <dir>/kubeconfig     admin kubeconfig, context ``rolloutfleet-sandbox-<name>``
    <dir>/logs/*.log     one log per component (kept after ``stop`` for post-mortems)
    <dir>/state.json     pids, ports and the etcd data dir of the running cluster (removed by ``stop``)

etcd keeps its data on tmpfs (``/dev/shm``) with ``--unsafe-no-fsync``: a test cluster is disposable
and fsync on 2 shared CI cores is what makes apiserver writes slow. Everything listens on 127.0.0.1 and
only 127.0.0.1 (and pod IPs in 127.1.0.0/16) is ever dialed; the service CIDR exists only because the
apiserver requires one.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import yaml

from rolloutfleet.resources import labels
from rolloutfleet.sandbox import binaries, certs, nodes, processes, waiting

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service's ClusterIP: in the cert SANs, never dialed
ISSUER = "https://kubernetes.default.svc.cluster.local"
# Stop order: kwok and controllers first so they do not log errors about a vanished apiserver.
COMPONENTS = ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")
CONTEXT_PREFIX = "rolloutfleet-sandbox-"
_PORTS = ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler", "kwok")


class ClusterError(RuntimeError):
    """The cluster could not start (the message carries the failing component's log tail)."""


def _stderr(message: str) -> None:
    print(f"[sandbox] {message}", file=sys.stderr, flush=True)


def free_ports(count: int) -> list[int]:
    # Hold all sockets open until every port is picked so that the ports are distinct.
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def kubectl(
    kubeconfig: pathlib.Path, *args: str, stdin: str | None = None, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """The cached kubectl against ``kubeconfig`` (built on first use); the caller reads the return code."""
    binary = str(binaries.ensure(("kubectl",))["kubectl"])
    command = [binary, f"--kubeconfig={kubeconfig}", *args]
    return subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)


def apply_crds(
    kubeconfig: pathlib.Path, paths: list[pathlib.Path], *, field_manager: str, timeout: float = 60.0
) -> list[str]:
    """Server-side apply CRD files or directories of them (the way docs/install.md applies the chart's: some
    are too large for client-side apply's annotation) and wait until every one is Established; returns their
    names. ``ClusterError`` with kubectl's message when either step fails."""
    files = [f for p in paths for f in (sorted(p.glob("*.yaml")) if p.is_dir() else [p])]
    names = [str(doc["metadata"]["name"]) for f in files for doc in yaml.safe_load_all(f.read_text()) if doc]
    apply = ["apply", "--server-side", "--force-conflicts", f"--field-manager={field_manager}"]
    wait = ["wait", "--for=condition=Established", f"--timeout={int(timeout)}s", *(f"crd/{n}" for n in names)]
    for args in ([*apply, *(a for f in files for a in ("-f", str(f)))], wait):
        done = kubectl(kubeconfig, *args, timeout=timeout + 30)
        if done.returncode != 0:
            raise ClusterError(f"kubectl {args[0]} of {len(names)} CRDs failed: {done.stderr.strip()}")
    return names


def _tmpfs() -> pathlib.Path | None:
    shm = pathlib.Path("/dev/shm")  # noqa: S108 -- tmpfs on purpose; the data dir itself is mkdtemp-private
    return shm if shm.is_dir() and shm.stat().st_mode & 0o002 else None


def _sweep_stale_data_dirs() -> None:
    # A test run killed with SIGKILL leaves its etcd data dir on tmpfs (its processes die with it, see
    # processes.py); remove any such dir that no running process refers to.
    base = _tmpfs()
    if base is None:
        return
    for stale in base.glob("rolloutfleet-etcd-*"):
        if not processes.matching(str(stale)):
            shutil.rmtree(stale, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    running: bool
    log: str


class Cluster:
    """One local control plane (etcd, apiserver, controller-manager, scheduler, kwok) in ``directory``.

    Node ``i`` gets pod subnet 127.1.<subnet_offset + i>.0/24. ``tie_to_parent=True`` (tests) makes the
    components die with the calling process and registers an ``atexit`` stop; ``False`` (``sandbox up``)
    leaves them running detached until ``sandbox down``.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        *,
        name: str = "default",
        nodes: int = 4,
        gpus_per_node: int = 8,
        pool: str = "default",
        subnet_offset: int = 0,
        tie_to_parent: bool = False,
        progress: Callable[[str], None] = _stderr,
        apiserver_profiling: bool = False,
    ) -> None:
        self.directory = directory
        self.name = name
        self.node_count = nodes
        self.gpus_per_node = gpus_per_node
        self.pool = pool
        self.subnet_offset = subnet_offset
        self.tie_to_parent = tie_to_parent
        self.progress = progress
        # The API server's /debug/pprof for benchmarks that ask where its CPU goes (bench/rollout_overhead.py
        # --apiserver-profile); off otherwise, as on a production control plane.
        self.apiserver_profiling = apiserver_profiling
        self._popens: dict[str, subprocess.Popen[bytes]] = {}

    @classmethod
    def named(cls, name: str = "default", **kwargs: Any) -> Cluster:
        """The cluster of ``rolloutfleet sandbox``: ``<cache>/clusters/<name>``."""
        return cls(binaries.cache_root() / "clusters" / name, name=name, **kwargs)

    # -- paths and identity -------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> pathlib.Path:
        return self.directory / "kubeconfig"

    @property
    def context(self) -> str:
        return CONTEXT_PREFIX + self.name

    @property
    def state_file(self) -> pathlib.Path:
        return self.directory / "state.json"

    @property
    def logs(self) -> pathlib.Path:
        return self.directory / "logs"

    @property
    def pki(self) -> certs.Pki:
        return certs.Pki(self.directory / "pki")

    def _state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return state

    def _write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.rename(self.state_file)

    def adopt(self, name: str, pid: int, binary: str, log: str, *, group: bool = True) -> None:
        """Record a process started beside the cluster (the demo's operator, the demo itself) so that
        ``stop`` — and so ``sandbox down`` from another shell — stops it too, before the control plane."""
        state = self._state()
        adopted = [r for r in state.get("adopted", []) if r.get("name") != name]
        record = processes.Record(name=name, pid=pid, binary=binary, log=log, group=group)
        state["adopted"] = [*adopted, dataclasses.asdict(record)]
        self._write_state(state)

    def adopt_this_process(self, name: str) -> None:
        """Record the calling process (not a group leader: only it is signalled) for ``sandbox down``."""
        argv = processes.cmdline(os.getpid())
        self.adopt(name, os.getpid(), argv[0] if argv else sys.executable, "(its terminal)", group=False)

    def adopted(self) -> list[processes.Record]:
        """What ``adopt`` recorded (the demo's operator, the demo process), stopped first by ``stop``."""
        return [processes.Record(**r) for r in self._state().get("adopted", [])]

    def _records(self) -> list[processes.Record]:
        found = {r["name"]: processes.Record(**r) for r in self._state().get("components", [])}
        return [found[name] for name in COMPONENTS if name in found]

    @property
    def server(self) -> str:
        port = self._state().get("ports", {}).get("apiserver")
        if not port:
            raise ClusterError(f"cluster {self.name!r} is not running ({self.state_file} missing)")
        return f"https://127.0.0.1:{port}"

    # -- inspection ---------------------------------------------------------------------------------

    def status(self) -> list[ComponentStatus]:
        return [ComponentStatus(r.name, r.pid, processes.alive(r), r.log) for r in self._records()]

    def running(self) -> bool:
        records = self._records()
        return len(records) == len(COMPONENTS) and all(processes.alive(r) for r in records)

    def pids(self) -> list[int]:
        """Every live process that mentions this cluster's directory or data dir (for leak checks)."""
        found = set(processes.matching(str(self.directory)))
        found.update(r.pid for r in self.adopted() if r.pid != os.getpid() and processes.alive(r))
        data_dir = self._state().get("etcd_data_dir")
        if data_dir:
            found.update(processes.matching(data_dir))
        return sorted(found)

    def component_metrics(self, name: str) -> str:
        """The /metrics text of ``kube-controller-manager`` or ``kube-scheduler`` (what each controller's work
        queue did: the bench's split of the control plane's CPU), read as the admin: they delegate the check to
        the apiserver (``_https_self_signed``)."""
        key = {"kube-controller-manager": "controller_manager", "kube-scheduler": "scheduler"}.get(name, "")
        port = self._state().get("ports", {}).get(key)
        if not port:
            raise ClusterError(f"no metrics port for {name!r} in cluster {self.name!r}")
        bearer = {"Authorization": f"Bearer {self.pki.admin_token()}"}
        return _https_self_signed(f"https://127.0.0.1:{port}/metrics", bearer).decode()

    # -- HTTP to the apiserver ----------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the apiserver against this cluster's CA (for callers that stream, e.g. watches)."""
        return ssl.create_default_context(cafile=str(self.pki.ca_cert))

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True, token: str | None = None) -> Any:
        """One JSON request to the apiserver: as the admin, with ``token``, or (``auth=False``) anonymous."""
        headers = {"Accept": "application/json"}
        bearer = token or (self.pki.admin_token() if auth else None)
        if bearer:
            headers["Authorization"] = f"Bearer {bearer}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.server + path, data=data, headers=headers, method=method)  # noqa: S310
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=30) as resp:  # noqa: S310
            raw = resp.read()
        return json.loads(raw) if raw.strip().startswith(b"{") else raw.decode()

    def create_nodes(self, count: int, *, start: int = 0, gpus: int | None = None) -> list[str]:
        """Create fake GPU nodes ``start .. start+count-1`` (existing ones are left as they are)."""
        names = []
        for index in range(start, start + count):
            gpu_count = self.gpus_per_node if gpus is None else gpus
            subnet = self.subnet_offset + index
            body = nodes.fake_gpu_node(index, gpus=gpu_count, pool=self.pool, subnet=subnet)
            try:
                self.request("POST", "/api/v1/nodes", body)
            except urllib.error.HTTPError as err:
                if err.code != 409:
                    raise
            names.append(body["metadata"]["name"])
        return names

    def wait_nodes_ready(self, names: list[str], timeout: float = 60.0) -> None:
        def ready() -> bool:
            items = self.request("GET", "/api/v1/nodes")["items"]
            done = {n["metadata"]["name"] for n in items if nodes.is_ready(n)}
            return done.issuperset(names)

        waiting.wait_for(ready, timeout=timeout, what=f"{len(names)} fake nodes Ready and untainted")

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> None:
        """Build or reuse the binaries, start every component, create the nodes, wait until usable."""
        if self.running():
            self.progress(f"cluster {self.name!r} already running ({self.server})")
            return
        if self._state():
            self.progress("cleaning up what a previous run left behind")
            self.stop(quiet=True)
        started = time.monotonic()
        # Only what runs: kubectl and helm are for people and chart tests, not for the cluster itself.
        paths = binaries.ensure(COMPONENTS[::-1])
        self.directory.mkdir(parents=True, exist_ok=True)
        pki = certs.ensure_pki(self.directory / "pki", SERVICE_IP)
        _sweep_stale_data_dirs()
        ports = dict(zip(_PORTS, free_ports(len(_PORTS)), strict=True))
        data_dir = tempfile.mkdtemp(prefix=f"rolloutfleet-etcd-{self.name}-", dir=_tmpfs() or self.directory)
        state: dict[str, Any] = {
            "name": self.name,
            "ports": ports,
            "etcd_data_dir": data_dir,
            "components": [],
            "started_at": time.time(),
        }
        self._write_state(state)
        if self.tie_to_parent:
            atexit.register(self._stop_at_exit)
        try:
            self._launch(state, paths, pki, ports, data_dir, deadline=time.monotonic() + timeout)
        except BaseException:
            self.progress(f"start failed; stopping what was started (logs in {self.logs})")
            self.stop(quiet=True)
            raise
        self.progress(f"cluster {self.name!r} ready in {time.monotonic() - started:.1f}s at {self.server}")

    def _spawn(self, state: dict[str, Any], name: str, argv: list[str]) -> None:
        proc, record = processes.spawn(name, argv, self.logs / f"{name}.log", tie_to_parent=self.tie_to_parent)
        self._popens[name] = proc
        state["components"].append(dataclasses.asdict(record))
        self._write_state(state)  # written per component so that `down` finds a half-started cluster

    def _await(self, name: str, check: Callable[[], bool], deadline: float, what: str = "") -> None:
        def probe() -> bool:
            proc = self._popens[name]
            if proc.poll() is not None:
                tail = "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-30:])
                raise ClusterError(f"{name} exited with {proc.returncode}; last log lines:\n{tail}")
            return check()

        errors = (OSError, urllib.error.URLError, ValueError, ssl.SSLError)
        remaining = max(1.0, deadline - time.monotonic())
        what = what or f"{name} ready"
        waiting.wait_for(probe, timeout=remaining, interval=0.1, what=what, ignore=errors)
        self.progress(what)

    def _launch(
        self,
        state: dict[str, Any],
        paths: dict[str, pathlib.Path],
        pki: certs.Pki,
        ports: dict[str, int],
        data_dir: str,
        *,
        deadline: float,
    ) -> None:
        etcd_url = f"http://127.0.0.1:{ports['etcd_client']}"
        peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
        self.progress(f"starting etcd (data on {data_dir})")
        self._spawn(state, "etcd", [
            str(paths["etcd"]), "--name=default", f"--data-dir={data_dir}",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
        ])  # fmt: skip
        self._await("etcd", lambda: _http_ok(f"{etcd_url}/health", b'"health":"true"'), deadline)

        self.progress("starting kube-apiserver")
        self._spawn(state, "kube-apiserver", [
            str(paths["kube-apiserver"]), "--bind-address=127.0.0.1", f"--secure-port={ports['apiserver']}",
            "--advertise-address=127.0.0.1", f"--etcd-servers={etcd_url}",
            f"--cert-dir={self.directory / 'pki'}",
            f"--tls-cert-file={pki.server_cert}", f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_cert}", f"--token-auth-file={pki.tokens}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={ISSUER}", f"--api-audiences={ISSUER}",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No Endpoints for the `kubernetes` Service: nothing may ever dial a non-loopback address.
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true", f"--profiling={str(self.apiserver_profiling).lower()}",
        ])  # fmt: skip
        self._await("kube-apiserver", lambda: self.request("GET", "/readyz") == "ok", deadline)
        self._write_configs(ports)

        kubeconfig = str(self.kubeconfig)
        delegated = [f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}"]
        self.progress("starting kube-controller-manager, kube-scheduler and kwok")
        self._spawn(state, "kube-controller-manager", [
            str(paths["kube-controller-manager"]), f"--kubeconfig={kubeconfig}", *delegated,
            "--bind-address=127.0.0.1", f"--secure-port={ports['controller_manager']}",
            "--leader-elect=false", f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
            # Node podCIDRs are ours (127.1.N.0/24, nodes.py); the IPAM controller must not hand out a
            # private range instead.
            "--allocate-node-cidrs=false",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])  # fmt: skip
        self._spawn(state, "kube-scheduler", [
            str(paths["kube-scheduler"]), f"--config={self.directory / 'scheduler.yaml'}", *delegated,
            "--bind-address=127.0.0.1", f"--secure-port={ports['scheduler']}",
        ])  # fmt: skip
        self._spawn(state, "kwok", [
            str(paths["kwok"]), f"--kubeconfig={kubeconfig}", f"--config={self.directory / 'kwok.yaml'}",
            f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}={nodes.KWOK_ANNOTATION_VALUE}",
            # Pod IPs come from each node's spec.podCIDR; --cidr is the fallback for a node without one
            # and is loopback too, never kwok's default 10.0.0.0/24.
            f"--cidr={nodes.FALLBACK_POD_CIDR}", "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{ports['kwok']}", "--node-lease-duration-seconds=40",
        ])  # fmt: skip
        names = self.create_nodes(self.node_count)
        self.progress(f"created {len(names)} fake GPU nodes ({self.gpus_per_node} x {nodes.GPU_RESOURCE} each)")
        cm, sched = ports["controller_manager"], ports["scheduler"]
        self._await("kube-controller-manager", lambda: _https_ok(f"https://127.0.0.1:{cm}/healthz"), deadline)
        self._await("kube-scheduler", lambda: _https_ok(f"https://127.0.0.1:{sched}/healthz"), deadline)
        self._await("kwok", lambda: _http_ok(f"http://127.0.0.1:{ports['kwok']}/healthz", b"ok"), deadline)
        self.wait_nodes_ready(names, timeout=max(1.0, deadline - time.monotonic()))
        # Pods are refused until the service-account controller made the namespace's `default` account.
        sa = "/api/v1/namespaces/default/serviceaccounts/default"
        has_sa = lambda: bool(self.request("GET", sa))  # noqa: E731
        self._await("kube-controller-manager", has_sa, deadline, what="service accounts minted")

    def _write_configs(self, ports: dict[str, int]) -> None:
        ca = self.pki.ca_cert.read_bytes()
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": self.context, "cluster": {
                "server": f"https://127.0.0.1:{ports['apiserver']}",
                "certificate-authority-data": base64.b64encode(ca).decode(),
            }}],
            "users": [{"name": self.context, "user": {"token": self.pki.admin_token()}}],
            "contexts": [{"name": self.context, "context": {"cluster": self.context, "user": self.context}}],
            "current-context": self.context,
        }  # fmt: skip
        self.kubeconfig.touch(mode=0o600)
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig, sort_keys=False))
        scheduler = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            # The default 50 QPS makes binding 1,000 pods take 20 s of pure client throttling.
            "clientConnection": {"kubeconfig": str(self.kubeconfig), "qps": 500, "burst": 1000},
            "leaderElection": {"leaderElect": False},
        }
        (self.directory / "scheduler.yaml").write_text(yaml.safe_dump(scheduler, sort_keys=False))
        # Only stages here: a KwokConfiguration document in --config replaces kwok's defaults wholesale
        # (it then fails with "node leases parallelism must be greater than 0"); the options are flags.
        stages = binaries.asset_path("kwok", "stages.yaml").read_text()
        (self.directory / "kwok.yaml").write_text(with_kubelet_readiness(without_gate_stage(stages)))

    def stop(self, *, quiet: bool = False) -> None:
        """Stop every component (process groups, SIGTERM then SIGKILL) and remove the etcd data."""
        state = self._state()
        records = self._records()
        if records and not quiet:
            self.progress(f"stopping cluster {self.name!r}")
        # What was started beside the cluster goes first (an operator left running would only log errors
        # against a stopped API server); the calling process never signals itself.
        processes.terminate([r for r in self.adopted() if r.pid != os.getpid()], {})
        processes.terminate(records, self._popens)
        self._popens.clear()
        data_dir = state.get("etcd_data_dir")
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        atexit.unregister(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(quiet=True)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _http_ok(url: str, expect: bytes) -> bool:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 -- loopback health endpoint
        return expect in resp.read()


def _https_ok(url: str) -> bool:
    return _https_self_signed(url, timeout=5).strip() == b"ok"


def _https_self_signed(url: str, headers: dict[str, str] | None = None, *, timeout: float = 30) -> bytes:
    """A GET from the controller-manager or scheduler. Each serves a self-signed certificate of its own, and
    this is loopback (their /healthz is public; /metrics is asked with the admin's token), so verification
    would buy nothing here."""
    req = urllib.request.Request(url, headers=headers or {})  # noqa: S310 -- loopback
    context = ssl._create_unverified_context()  # noqa: S323
    with urllib.request.urlopen(req, context=context, timeout=timeout) as resp:  # noqa: S310
        return bytes(resp.read())


# kwok's pod-ready stage marks every readiness gate True as the pod starts, which no kubelet does: a gate
# belongs to its controller (ours: rolloutfleet.io/weights-ready, set by the operator from the engine).
_GATE_STAGE = re.compile(r"\n[ \t]*\{\{ range \.spec\.readinessGates \}\}.*?\{\{ end \}\}", re.DOTALL)


def without_gate_stage(stages: str) -> str:
    """kwok's stages without the template block that sets readiness gates (the operator sets ours)."""
    return _GATE_STAGE.sub("", stages)


# A kubelet's Ready is its containers ready *and* every readiness gate of the pod's spec True, recomputed
# whenever a gate changes; kwok's pod-ready stage marks Ready True once at start, whatever the gates say. So
# in the sandbox a pod was Ready (behind its Service, counted by its StatefulSet and disruption budget) before
# the operator opened its gate, stayed Ready while the gate was closed for a reload, and a gate change made
# one pod update where a cluster makes two (bench/results/rollout_overhead.md). The pod-ready stage now starts
# a gated pod not Ready, and two stages of ours flip Ready after the weights gate, as a kubelet does.
_READY_AT_START = re.compile(r'(\n[ \t]*status: )"True"(\n[ \t]*type: Ready\n)')


def _pod_stage(name: str, match: list[tuple[str, str, str]], ready: dict[str, str]) -> dict[str, Any]:
    """A kwok Stage for a running pod not being deleted, whose conditions match ``match`` ((jq key, operator,
    value)), that sets the pod's Ready condition to ``ready`` (a strategic merge: the other conditions stay)."""
    expressions = [
        {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
        {"key": ".status.phase", "operator": "In", "values": ["Running"]},
        *({"key": key, "operator": op, "values": [value]} for key, op, value in match),
    ]
    # A Go template that renders YAML (kwok's own stages write theirs so): the time is the template's to quote.
    fields = "".join(f"  {key}: {json.dumps(value)}\n" for key, value in ready.items())
    template = "conditions:\n- lastTransitionTime: {{ Now | Quote }}\n" + fields + "  type: Ready\n"
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": expressions},
            "next": {"statusTemplate": template},
        },
    }


def _condition(type_: str) -> str:
    return f'.status.conditions.[] | select( .type == "{type_}" ) | .status'


def _gated_ready_stages(gate: str) -> list[dict[str, Any]]:
    """Ready after ``gate`` as a kubelet decides it: True once the containers are ready and the gate is True,
    False (``ReadinessGatesNotReady``, the kubelet's reason) once the gate is anything else."""
    declares = (f'.spec.readinessGates.[] | select( .conditionType == "{gate}" ) | .conditionType', "In", gate)
    opened = [(_condition("ContainersReady"), "In", "True"), (_condition(gate), "In", "True")]
    return [
        _pod_stage("pod-gate-opened-ready", [*opened, (_condition("Ready"), "NotIn", "True")], {"status": "True"}),
        _pod_stage(
            "pod-gate-closed-not-ready",
            [declares, (_condition(gate), "NotIn", "True"), (_condition("Ready"), "In", "True")],
            {"reason": "ReadinessGatesNotReady", "status": "False"},
        ),
    ]


def with_kubelet_readiness(stages: str) -> str:
    """kwok's stages with a kubelet's readiness rule for the weights gate (the comment above): a pod that declares
    readiness gates starts not Ready, and Ready follows the weights gate while its containers are ready. Only our
    gate is followed: the sandbox's pods declare no other (a pod gated on another stays not Ready here)."""
    documents = stages.split("\n---\n")
    for i, document in enumerate(documents):
        if re.search(r"^[ \t]*name: pod-ready[ \t]*$", document, re.M):
            started, found = _READY_AT_START.subn(
                r'\1{{ if .spec.readinessGates }}"False"{{ else }}"True"{{ end }}\2', document, count=1
            )
            if not found:
                raise ClusterError("kwok's pod-ready stage has no Ready condition to follow the readiness gates")
            documents[i] = started
            break
    else:
        raise ClusterError("kwok's stages have no pod-ready stage")
    ours = yaml.safe_dump_all(_gated_ready_stages(labels.WEIGHTS_READY_CONDITION), sort_keys=False)
    return "\n---\n".join(documents).rstrip("\n") + "\n---\n" + ours
