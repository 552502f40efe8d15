"""The import contracts in pyproject.toml can fail, and the test rig stays out of the product.

A contract that cannot fail is decoration (STYLE.md). Each case copies ``operator/``, ``worker_image/`` and
``digest/`` into a temporary directory, plants one forbidden import, runs ``lint-imports`` there with the project's
own ``pyproject.toml``, and asserts that exactly the contracts meant to catch that import break; the
unplanted copy must keep every contract. Together the plants must break every contract in the file, so
adding a contract without a plant that breaks it fails here too.

The operator image (``Dockerfile``) does not ship ``rolloutfleet.sim``, ``rolloutfleet.sandbox`` or the worker
package; the last tests check that every remaining module imports without them, and that the Dockerfile
strips what the test-tooling contract calls test tooling.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
CONTRACTS: list[dict[str, object]] = PYPROJECT["tool"]["importlinter"]["contracts"]
ALL_NAMES = {str(c["name"]) for c in CONTRACTS}

# `lint-imports` prints one line per contract: "<name> KEPT" or "<name> BROKEN", maybe "(1 ignored import)".
_VERDICT = re.compile(r"^(?P<name>.+) (?P<verdict>KEPT|BROKEN)(?: \(.*\))?$")
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _contract(fragment: str) -> str:
    """The one contract whose name contains ``fragment`` (names are long; tests refer to them by a part)."""
    matches = [name for name in ALL_NAMES if fragment in name]
    assert len(matches) == 1, f"{fragment!r} names {len(matches)} contracts: {matches}"
    return matches[0]


LAYERS = _contract("rolloutfleet layers (exhaustive)")
TRAINER_LAYERS = _contract("trainer client layers (exhaustive)")
TOOLING = _contract("test tooling")
ACYCLIC = _contract("no import cycles")
TRAINER_TO_OPERATOR = _contract("trainer client never imports")
OPERATOR_TO_TRAINER = _contract("operator runtime never imports")
PURE = _contract("pure layers do no I/O")
NO_TORCH = _contract("never imports torch")
WORKER = _contract("worker package never imports")
DIGEST = _contract("digest definition imports neither")

# id: (module file, line appended to it, contracts that must break: no more, no fewer). The file is under
# operator/ for `rolloutfleet`, under worker_image/ for `rolloutfleet_worker`, under digest/ for the digest.
PLANTS: dict[str, tuple[str, str, set[str]]] = {
    # The review's example: the simulator reached from the reconcile core.
    "sim-in-reconcile": ("rolloutfleet/reconcile/revision.py", "from rolloutfleet import sim", {LAYERS, TOOLING}),
    # The sandbox from the lowest layer; also a cycle, since the sandbox demo imports api, and the trainer client
    # (which imports api) would reach the operator's resources through it (the sandbox's cluster reads the
    # weights gate's name from resources.labels).
    "sandbox-in-api": (
        "rolloutfleet/api/common.py",
        "from rolloutfleet.sandbox import cluster",
        {LAYERS, TOOLING, ACYCLIC, TRAINER_TO_OPERATOR},
    ),
    # Upward: the pure planner reaching for the kopf layer, closing a cycle through reconcile.
    "planning-to-handlers": (
        "rolloutfleet/planning/rollout.py",
        "from rolloutfleet import handlers",
        {LAYERS, ACYCLIC},
    ),
    # Upward, and since the trainer client imports api, it would reach the operator's planner through it.
    "api-to-planning": (
        "rolloutfleet/api/fleet.py",
        "import rolloutfleet.planning.rollout",
        {LAYERS, ACYCLIC, TRAINER_TO_OPERATOR},
    ),
    # A cycle inside one package, which no top-level layer sees: revisions already imports transaction.
    "cycle-in-planning": ("rolloutfleet/planning/transaction.py", "import rolloutfleet.planning.revisions", {ACYCLIC}),
    # A new top-level module that no layer declares (exhaustive = true).
    "undeclared-module": ("rolloutfleet/shortcut.py", '"""A module no layer declares."""', {LAYERS}),
    "undeclared-trainer-module": (
        "rolloutfleet/trainer/shortcut.py",
        '"""A module no layer declares."""',
        {TRAINER_LAYERS},
    ),
    # Downward by tier, so the layers allow it; only the boundary between the two products stops it.
    "trainer-to-planning": (
        "rolloutfleet/trainer/publish.py",
        "import rolloutfleet.planning.rollout",
        {TRAINER_TO_OPERATOR},
    ),
    # The trainer package sits level with the handlers, so this is upward for the layers too; the boundary
    # contract states the same rule outright.
    "resources-to-trainer": (
        "rolloutfleet/resources/labels.py",
        "import rolloutfleet.trainer.errors",
        {LAYERS, OPERATOR_TO_TRAINER},
    ),
    # Inside the trainer package: the lowest layer reaching up to the push client (also a cycle, since
    # push imports errors).
    "trainer-errors-to-push": (
        "rolloutfleet/trainer/errors.py",
        "import rolloutfleet.trainer.push",
        {TRAINER_LAYERS, ACYCLIC},
    ),
    # torch anywhere in the trainer client but its one torch module (tensors) breaks the torch contract.
    "trainer-push-imports-torch": ("rolloutfleet/trainer/push.py", "import torch", {NO_TORCH}),
    "planning-does-io": ("rolloutfleet/planning/rollout.py", "import kubernetes", {PURE}),
    "operator-imports-torch": ("rolloutfleet/adapters/engine.py", "import torch", {NO_TORCH}),
    "worker-imports-kopf": ("rolloutfleet_worker/auth.py", "import kopf", {WORKER}),
    # Both images ship the digest; reaching into either package from it would drag that package along, and
    # the operator, which imports the digest, would then reach the worker package through it.
    "digest-imports-worker": (
        "rolloutfleet_digest/__init__.py",
        "import rolloutfleet_worker.records",
        {DIGEST, NO_TORCH},
    ),
}

_ROOTS = ("operator", "worker_image", "digest")


def _root_of(path: str) -> str:
    return {"rolloutfleet_worker": "worker_image", "rolloutfleet_digest": "digest"}.get(path.split("/")[0], "operator")


def _copy_tree(dest: pathlib.Path) -> pathlib.Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for root in _ROOTS:
        shutil.copytree(REPO / root, dest / root, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _env(tree: pathlib.Path) -> dict[str, str]:
    # The copy comes first on sys.path, ahead of the editable install of the checkout; COLUMNS stops the
    # report wrapping contract names.
    pythonpath = os.pathsep.join(str(tree / root) for root in _ROOTS)
    return {**os.environ, "PYTHONPATH": pythonpath, "COLUMNS": "1000"}


def _lint(tree: pathlib.Path) -> tuple[int, dict[str, str], str]:
    """Run ``lint-imports`` in ``tree``: exit code, ``{contract name: KEPT|BROKEN}``, and the full report."""
    proc = subprocess.run(
        [sys.executable, "-c", _LINT, "--no-cache"],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    report = proc.stdout + proc.stderr
    verdicts = {m["name"]: m["verdict"] for line in report.splitlines() if (m := _VERDICT.match(line.strip()))}
    return proc.returncode, verdicts, report


def test_the_unplanted_tree_keeps_every_contract(tmp_path: pathlib.Path) -> None:
    code, verdicts, report = _lint(_copy_tree(tmp_path))
    assert code == 0, report
    assert verdicts == dict.fromkeys(ALL_NAMES, "KEPT"), report


def test_every_contract_is_broken_by_some_plant() -> None:
    # A contract no plant breaks is one nobody has shown can fail: add a plant for it.
    assert set().union(*(broken for *_, broken in PLANTS.values())) == ALL_NAMES


@pytest.mark.parametrize("case", PLANTS)
def test_a_planted_import_breaks_exactly_its_contracts(tmp_path: pathlib.Path, case: str) -> None:
    path, line, broken = PLANTS[case]
    tree = _copy_tree(tmp_path)
    target = tree / _root_of(path) / path
    before = target.read_text(encoding="utf-8") if target.exists() else ""
    target.write_text(f"{before}\n{line}  # planted\n", encoding="utf-8")
    code, verdicts, report = _lint(tree)
    assert code != 0, report
    assert set(verdicts) == ALL_NAMES, report
    assert {name for name, verdict in verdicts.items() if verdict == "BROKEN"} == broken, report


# Imports every module left in the copy after sim/, sandbox/ and the worker package are gone, as the operator
# image holds it (the trainer's GPU digest imports the worker lazily, only when handed CUDA tensors).
# The editable install of the checkout would otherwise find the deleted packages (its finder maps
# subpackages of `rolloutfleet` to the checkout), so it is dropped from sys.meta_path first.
_IMPORT_ALL_WITHOUT_RIG = """
import importlib, pkgutil, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
import rolloutfleet
names = [m.name for m in pkgutil.walk_packages(rolloutfleet.__path__, "rolloutfleet.")]
for name in names:
    importlib.import_module(name)
for rig in ("rolloutfleet.sim", "rolloutfleet.sandbox", "rolloutfleet_worker"):
    try:
        importlib.import_module(rig)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"{rig} is still importable")
from rolloutfleet import cli
try:
    cli.main(["run", "--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
print(len(names), "modules", *sorted(names))
"""


def test_production_modules_import_without_sim_sandbox_and_worker(tmp_path: pathlib.Path) -> None:
    tree = _copy_tree(tmp_path)
    for rig in ("sim", "sandbox"):
        shutil.rmtree(tree / "operator" / "rolloutfleet" / rig)
    shutil.rmtree(tree / "worker_image")
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL_WITHOUT_RIG],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    imported = set(proc.stdout.split())
    assert {"rolloutfleet.handlers.wiring", "rolloutfleet.cli", "rolloutfleet.trainer.cli.publish"} <= imported


def test_the_operator_image_strips_what_the_contract_calls_test_tooling() -> None:
    (tooling,) = (c for c in CONTRACTS if c["name"] == TOOLING)
    forbidden = tooling["forbidden_modules"]
    assert isinstance(forbidden, list)
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    strip = next(line for line in dockerfile.splitlines() if line.strip().startswith("RUN rm -rf operator/"))
    for module in forbidden:
        assert f"operator/{module.replace('.', '/')}" in strip.split(), f"the Dockerfile ships {module}"
