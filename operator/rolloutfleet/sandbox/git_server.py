"""A Git server on loopback: smart HTTP through ``git http-backend`` (CGI) behind a small Python server.

Called by :mod:`rolloutfleet.sandbox.flux` (``sandbox up --flux`` runs it as a child process,
:class:`GitServerProcess`) and by the Git-driven integration tier (``tests/integration/gitops``, in
process, :class:`GitServer`). It owns the repositories under its root directory: bare repositories that
accept anonymous pushes (``http.receivepack``), which is what Flux's source-controller clones and a test
(or a user) pushes to. It listens on 127.0.0.1 only; nothing here dials anything but loopback.

Why ``git http-backend``: it is Git's own smart-HTTP implementation (protocol v2, packs, push), so Flux
talks to a real Git server, not to a file path; the Python part only turns HTTP requests into CGI calls.
:class:`WorkingCopy` is the other side: a clone that commits and pushes like a platform team's CI job.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from rolloutfleet.sandbox import cluster, processes, waiting

HOST = "127.0.0.1"
BRANCH = "main"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never via a proxy
# Commits are made by the sandbox, never by a user's identity or hooks from their global configuration.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "rolloutfleet sandbox",
    "GIT_AUTHOR_EMAIL": "sandbox@rolloutfleet.invalid",
    "GIT_COMMITTER_NAME": "rolloutfleet sandbox",
    "GIT_COMMITTER_EMAIL": "sandbox@rolloutfleet.invalid",
    "GIT_TERMINAL_PROMPT": "0",
    # The only remote is this loopback server: never through a proxy the user's environment names.
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def git(*args: str, cwd: pathlib.Path | None = None, timeout: float = 60.0) -> str:
    """Run one git command with the sandbox's identity; raise with git's own message when it fails."""
    env = {**os.environ, **_GIT_ENV}
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def create_repository(root: pathlib.Path, name: str) -> pathlib.Path:
    """A bare repository ``<root>/<name>.git`` on branch ``main`` that accepts anonymous pushes over HTTP."""
    repo = root / f"{name}.git"
    root.mkdir(parents=True, exist_ok=True)
    git("init", "--quiet", "--bare", f"--initial-branch={BRANCH}", str(repo))
    # http-backend refuses receive-pack to an unauthenticated client unless the repository allows it.
    git("config", "http.receivepack", "true", cwd=repo)
    return repo


def seed(repo: pathlib.Path, files: Mapping[str, str], *, message: str) -> str:
    """Commit ``files`` (path -> text) to ``repo``'s main branch through a temporary clone; returns the sha."""
    with WorkingCopy.clone(str(repo), repo.parent / f".seed-{repo.stem}-{os.getpid()}") as copy:
        for path, text in files.items():
            copy.write(path, text)
        return copy.commit_and_push(message)


class WorkingCopy:
    """A clone that writes, removes, commits and pushes files (the platform team's side of GitOps)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory

    @classmethod
    def clone(cls, url: str, directory: pathlib.Path) -> WorkingCopy:
        git("clone", "--quiet", url, str(directory))
        # An empty repository's clone has no branch yet; commits go to main either way.
        git("checkout", "--quiet", "-B", BRANCH, cwd=directory)
        return cls(directory)

    def write(self, path: str, text: str) -> None:
        target = self.directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    def remove(self, path: str) -> None:
        (self.directory / path).unlink()

    def commit_and_push(self, message: str) -> str:
        """Commit everything and push to main; returns the commit's sha (what Flux reports as applied)."""
        git("add", "--all", cwd=self.directory)
        git("commit", "--quiet", "--allow-empty", "-m", message, cwd=self.directory)
        return self._push()

    def revert_last(self, message: str) -> str:
        """Undo the last commit with a new one (history is never rewritten under Flux) and push it."""
        git("revert", "--no-edit", "HEAD", cwd=self.directory)
        git("commit", "--quiet", "--amend", "-m", message, cwd=self.directory)  # the revert's own message
        return self._push()

    def _push(self) -> str:
        git("push", "--quiet", "origin", f"HEAD:{BRANCH}", cwd=self.directory)
        return git("rev-parse", "HEAD", cwd=self.directory).strip()

    def __enter__(self) -> WorkingCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    root: pathlib.Path
    log_file: pathlib.Path | None


class _Handler(http.server.BaseHTTPRequestHandler):
    """One HTTP request -> one ``git http-backend`` run (CGI/1.1), its output relayed as the response."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self._cgi()

    def do_POST(self) -> None:
        self._cgi()

    def _body(self) -> bytes:
        # git sends pushes larger than http.postBuffer chunked; CGI wants the whole body with its length.
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    body = b"".join(parts)
                    self._note(f"chunked request body: {len(body)} bytes")
                    return body
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _cgi(self) -> None:
        path, _, query = self.path.partition("?")
        body = self._body() if self.command == "POST" else b""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GATEWAY_INTERFACE": "CGI/1.1",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "SERVER_SOFTWARE": "rolloutfleet-sandbox-git",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": urllib.parse.unquote(path),
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
        }
        # A gzipped request body (git compresses large negotiations) and the protocol version (v2).
        for header, variable in (("Content-Encoding", "HTTP_CONTENT_ENCODING"), ("Git-Protocol", "GIT_PROTOCOL")):
            if self.headers.get(header):
                env[variable] = self.headers[header]
        done = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, timeout=300, check=False
        )
        if done.stderr:
            self._note(done.stderr.decode(errors="replace").strip())
        head, sep, payload = done.stdout.partition(b"\r\n\r\n")
        if not sep:
            head, sep, payload = done.stdout.partition(b"\n\n")
        if not sep:
            self.send_error(500, "git http-backend gave no response")
            return
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            key, _, value = line.partition(":")
            if key.lower() == "status":
                status = int(value.split()[0])
            elif key and key.lower() != "content-length":
                headers.append((key, value.strip()))
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _note(self, text: str) -> None:
        if self.server.log_file is not None:
            with self.server.log_file.open("a") as sink:
                sink.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def log_message(self, format: str, *args: Any) -> None:
        self._note(format % args)


class GitServer:
    """The server in this process (a daemon thread): ``start()``, ``url``, ``stop()``."""

    def __init__(self, root: pathlib.Path, *, port: int = 0, log: pathlib.Path | None = None) -> None:
        self.root = root
        self.port = port
        self.log = log
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> GitServer:
        self.root.mkdir(parents=True, exist_ok=True)
        server = _Server((HOST, self.port), _Handler)
        server.root, server.log_file = self.root, self.log
        self._server, self.port = server, server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, daemon=True, name="git-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> GitServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class GitServerProcess:
    """The server as a child process (``python -m rolloutfleet.sandbox.git_server``), for a detached
    sandbox whose Git server must outlive the command that started it."""

    def __init__(self, root: pathlib.Path, log: pathlib.Path, *, tie_to_parent: bool) -> None:
        self.root = root
        self.log = log
        self.tie_to_parent = tie_to_parent
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._record: processes.Record | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def record(self) -> processes.Record:
        if self._record is None:
            raise RuntimeError("the Git server is not started")
        return self._record

    def start(self, timeout: float = 20.0) -> None:
        (self.port,) = cluster.free_ports(1)
        argv = [sys.executable, "-m", "rolloutfleet.sandbox.git_server", "--root", str(self.root)]
        argv += ["--port", str(self.port), "--log", str(self.log)]
        self._proc, self._record = processes.spawn("git-server", argv, self.log, tie_to_parent=self.tie_to_parent)

        def answers() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"the Git server exited with {self._proc.returncode}; see {self.log}")
            try:
                with _DIRECT.open(f"{self.url}/", timeout=2):
                    return True
            except urllib.error.HTTPError:
                return True  # any HTTP answer: it is serving

        waiting.wait_for(answers, timeout=timeout, interval=0.1, what="the Git server", ignore=(OSError,))

    def stop(self) -> None:
        if self._record is not None:
            processes.terminate([self._record], {"git-server": self._proc} if self._proc else {})


def main(argv: list[str] | None = None) -> int:
    """Serve ``--root`` on 127.0.0.1:``--port`` until SIGTERM (how :class:`GitServerProcess` runs it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    server = GitServer(args.root, port=args.port, log=args.log).start()
    print(f"serving {args.root} at {server.url}", flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    with contextlib.suppress(KeyboardInterrupt):
        while not stopped.wait(0.5):  # a timed wait: the signal handler runs between waits
            pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
