"""Child processes of the local control plane: spawn in their own process group, find, terminate.

Called by :mod:`rolloutfleet.sandbox.cluster` only. It owns no state: a cluster records what it started
in its ``state.json`` (so that ``sandbox down`` in another process can stop it), and the in-process
``Popen`` objects stay with the ``Cluster`` that made them.

Why process groups: each component runs as the leader of a new session, so a stop signals the whole
group (nothing a component forks can escape) and a Ctrl-C in the user's terminal does not reach the
detached sandbox. Why ``PR_SET_PDEATHSIG`` for test clusters: if pytest is killed outright (SIGKILL, OOM,
a CI timeout) no Python cleanup runs; the kernel then kills the children for us.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterable

_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Record:
    """What ``state.json`` keeps about one started component."""

    name: str
    pid: int
    binary: str
    log: str
    group: bool = True  # a session leader of its own group (spawned here); False: signal the process alone


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(
    name: str, argv: list[str], log: pathlib.Path, *, tie_to_parent: bool
) -> tuple[subprocess.Popen[bytes], Record]:
    """Start one component as a session leader with stdout and stderr appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        sink.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(argv)}\n".encode())
        sink.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if tie_to_parent else None,
            close_fds=True,
        )
    return proc, Record(name=name, pid=proc.pid, binary=argv[0], log=str(log))


def cmdline(pid: int) -> list[str]:
    try:
        raw = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _zombie(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def alive(record: Record) -> bool:
    """The recorded process still runs the recorded binary (a reused pid does not count)."""
    args = cmdline(record.pid)
    return bool(args) and args[0] == record.binary and not _zombie(record.pid)


def matching(needle: str) -> list[int]:
    """Pids of live processes whose command line mentions ``needle`` (a cluster dir, a data dir)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if any(needle in arg for arg in cmdline(pid)) and not _zombie(pid):
                found.append(pid)
    return sorted(found)


def _signal(record: Record, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if record.group:
            os.killpg(record.pid, sig)
        else:
            os.kill(record.pid, sig)


def terminate(records: Iterable[Record], popens: dict[str, subprocess.Popen[bytes]], *, grace: float = 10.0) -> None:
    """Stop the groups one by one in the given order: SIGTERM, then SIGKILL after ``grace`` seconds.

    One by one because the apiserver drains its requests on SIGTERM and waits for etcd while it does:
    signalling etcd at the same time turns a one-second shutdown into a ten-second one.
    """
    for record in records:
        if not alive(record):
            continue
        _signal(record, signal.SIGTERM)
        proc = popens.get(record.name)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive(record):
            if proc is not None:
                proc.poll()  # reap our own child so that it does not linger as a zombie
            time.sleep(0.02)
        _signal(record, signal.SIGKILL)  # also whatever the leader may have forked
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
