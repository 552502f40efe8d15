"""The pure parts of Flux in the sandbox (rolloutfleet.sandbox.flux, .git_server): the go.mod rewrite that
makes a Flux controller's module buildable from a copy, the health rules shared with the published Flux
example, the example's CRD-prune rule, and the Git server's smart-HTTP relay (real git, loopback only).

Nothing is built and no cluster is started.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import yaml

from rolloutfleet.sandbox import flux, git_server

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[3]

# The shape of github.com/fluxcd/source-controller v1.9.6's go.mod, shortened.
SOURCE_CONTROLLER_GOMOD = """module github.com/fluxcd/source-controller

go 1.26.0

replace github.com/fluxcd/source-controller/api => ./api

// Replace digest lib to master to gather access to BLAKE3.
replace github.com/opencontainers/go-digest => github.com/opencontainers/go-digest v1.0.1-0.20220411205349-bde1400a84be

require (
\tgithub.com/fluxcd/pkg/artifact v0.18.3
\tgithub.com/fluxcd/source-controller/api v1.9.6
)
"""


def test_the_local_api_replace_is_dropped_and_the_pin_appended() -> None:
    rewrite = flux.rewrite_gomod(SOURCE_CONTROLLER_GOMOD, (flux.ARTIFACT_PIN,))
    assert rewrite.dropped == ("github.com/fluxcd/source-controller/api",)
    lines = rewrite.text.splitlines()
    assert not any("=> ./api" in line for line in lines)
    # Replaces of published versions stay; the requirement of the api module stays (it now resolves remotely).
    assert any(line.startswith("replace github.com/opencontainers/go-digest =>") for line in lines)
    assert "\tgithub.com/fluxcd/source-controller/api v1.9.6" in lines
    assert lines[-1] == "replace github.com/fluxcd/pkg/artifact => github.com/fluxcd/pkg/artifact v0.18.1"


def test_local_replaces_inside_a_block_are_dropped_and_the_others_kept() -> None:
    gomod = """module github.com/fluxcd/kustomize-controller

replace (
\tgithub.com/fluxcd/kustomize-controller/api => ./api // the api directory
\tsigs.k8s.io/kustomize/api => sigs.k8s.io/kustomize/api v0.21.1
\texample.com/tool v1.2.3 => ../tool
)

require (
\tgithub.com/fluxcd/kustomize-controller/api v1.9.6
\texample.com/tool v1.2.3
)
"""
    rewrite = flux.rewrite_gomod(gomod)
    assert rewrite.dropped == ("github.com/fluxcd/kustomize-controller/api", "example.com/tool")
    assert "sigs.k8s.io/kustomize/api => sigs.k8s.io/kustomize/api v0.21.1" in rewrite.text
    assert "./api" not in rewrite.text and "../tool" not in rewrite.text


def test_a_go_mod_without_a_local_replace_is_refused() -> None:
    # The recipe exists because of the local replace; without one, upstream changed and the recipe must too.
    with pytest.raises(ValueError, match="no replace directive points at a local path"):
        flux.rewrite_gomod("module x\n\nrequire y v1.0.0\n")


def test_a_dropped_module_must_be_required_at_a_version() -> None:
    with pytest.raises(ValueError, match="required at no version"):
        flux.rewrite_gomod("module x\n\nreplace x/api => ./api\n")


def test_a_pin_never_collides_with_an_existing_replace() -> None:
    pin = ("github.com/opencontainers/go-digest", "v1.0.0")
    with pytest.raises(ValueError, match="already replaced"):
        flux.rewrite_gomod(SOURCE_CONTROLLER_GOMOD, (pin,))


def test_the_pinned_versions_are_the_ones_documented() -> None:
    text = (REPO / "docs" / "gitops" / "README.md").read_text()
    for controller in flux.CONTROLLERS:
        assert f"{controller.name} {controller.version}" in text, controller
    assert f"{flux.ARTIFACT_PIN[0]} {flux.ARTIFACT_PIN[1]}" in text


def _normalized(exprs: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{key: " ".join(str(value).split()) for key, value in expr.items()} for expr in exprs]


def test_the_sandbox_health_rules_are_the_published_ones() -> None:
    published = yaml.safe_load((REPO / "docs" / "gitops" / "flux" / "fleet-sync.yaml").read_text())
    assert _normalized(published["spec"]["healthCheckExprs"]) == _normalized(flux.HEALTH_CHECK_EXPRS)


def _manifests(directory: pathlib.Path) -> list[dict[str, object]]:
    """Every object a kustomization.yaml in ``directory`` lists, following nested directories."""
    listed = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out: list[dict[str, object]] = []
    for resource in listed.get("resources") or []:
        path = directory / resource
        if path.is_dir():
            out += _manifests(path)
        else:
            out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def test_no_pruned_flux_kustomization_of_the_example_carries_a_crd() -> None:
    """The CRD-prune trap: a pruned (or deleted) Kustomization that applied the CRDs deletes them, and with
    them every RolloutFleet and WeightRevision. The chart owns the CRDs; the example must keep it so."""
    examples = sorted((REPO / "docs" / "gitops" / "flux").glob("*-sync.yaml"))
    assert examples
    for sync in examples:
        spec = yaml.safe_load(sync.read_text())["spec"]
        objects = _manifests(REPO / spec["path"])
        assert objects, sync
        kinds = {str(o["kind"]) for o in objects}
        assert "CustomResourceDefinition" not in kinds, (
            f"{sync.name} applies CRDs in a Kustomization (prune={spec.get('prune')})"
        )


def test_the_git_server_relays_clone_and_push_including_chunked_bodies(tmp_path: pathlib.Path) -> None:
    with git_server.GitServer(tmp_path / "repos", log=tmp_path / "server.log") as server:
        repo = git_server.create_repository(server.root, "config")
        seeded = git_server.seed(repo, {"fleet/a.yaml": "a: 1\n"}, message="seed")
        url = f"{server.url}/{repo.name}"
        with git_server.WorkingCopy.clone(url, tmp_path / "one") as copy:
            assert (copy.directory / "fleet" / "a.yaml").read_text() == "a: 1\n"
            # Random bytes do not compress: with a 1 KiB post buffer git sends the pack chunked.
            (copy.directory / "fleet" / "blob.bin").write_bytes(os.urandom(64 * 1024))
            git_server.git("add", "--all", cwd=copy.directory)
            git_server.git("commit", "--quiet", "-m", "blob", cwd=copy.directory)
            git_server.git("-c", "http.postBuffer=1024", "push", "--quiet", "origin", "HEAD:main", cwd=copy.directory)
            pushed = git_server.git("rev-parse", "HEAD", cwd=copy.directory).strip()
        assert pushed != seeded
        with git_server.WorkingCopy.clone(url, tmp_path / "two") as again:
            assert git_server.git("rev-parse", "HEAD", cwd=again.directory).strip() == pushed
        log = (tmp_path / "server.log").read_text()
        assert "git-receive-pack" in log and "git-upload-pack" in log
        assert "chunked request body" in log


def test_the_git_server_answers_a_missing_repository_with_404(tmp_path: pathlib.Path) -> None:
    with git_server.GitServer(tmp_path) as server:
        done = subprocess.run(
            ["git", "ls-remote", f"{server.url}/absent.git"], capture_output=True, text=True, timeout=30, check=False
        )
        assert done.returncode != 0
        assert "not found" in done.stderr.lower() or "404" in done.stderr, done.stderr
