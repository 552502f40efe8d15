# The rolloutfleet operator image: `rolloutfleet run` (kopf) on a slim Python 3.11, as a non-root user.
#
# Build context: the repository root, nothing else needed.
#   docker build -t REGISTRY/rolloutfleet-operator:0.1.0 .
#
# The project is installed WITHOUT its `worker` (torch, vLLM-side) and `dev` extras: the operator never
# imports torch or vLLM. Two distributions go in: the operator (pyproject.toml, operator/) and the digest
# definition it shares with the engines (digest/); the worker package (worker_image/) is its own
# distribution and is not even copied in. Versions are pinned by constraints.txt, the same pins CI tests.
#
# Runs with a read-only root filesystem: nothing is written outside /tmp (the chart mounts an emptyDir
# there). PYTHONDONTWRITEBYTECODE stops Python trying to write .pyc files next to the sources; the
# bytecode is compiled at build time instead.

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY operator ./operator
COPY digest ./digest
# The test rig (rolloutfleet.sim, rolloutfleet.sandbox) is not part of the product: it is deleted before the
# wheel is built, so the image never holds it. Nothing left imports it (the "test tooling" import contract
# in pyproject.toml; tests/unit/test_import_contracts.py checks this line names what that contract names).
# The checks: every shipped module imports, the rig, the worker package and torch do not, and
# `rolloutfleet run` parses (tests/images/ repeats them on the built image).
RUN rm -rf operator/rolloutfleet/sim operator/rolloutfleet/sandbox
# Then two things nothing at runtime uses leave the venv (bench/results/images.md: 387 MB image before):
# the asyncio client the kubernetes package ships beside its sync one (kubernetes/aio, 68 MB; the operator
# talks to the API server through kopf and its own aiohttp session, and uses the package only for its
# config loading and a few sync calls), and pip itself. The import checks below run after the removal.
RUN python -m venv /opt/rolloutfleet \
    && /opt/rolloutfleet/bin/pip install --no-cache-dir -c constraints.txt ./digest . \
    && site="$(/opt/rolloutfleet/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "$site/kubernetes/aio" \
    && /opt/rolloutfleet/bin/python -m pip uninstall -q -y pip \
    && /opt/rolloutfleet/bin/python -m compileall -q /opt/rolloutfleet/lib \
    && /opt/rolloutfleet/bin/python -c "import importlib as i, pkgutil as p, rolloutfleet as r; \
        [i.import_module(m.name) for m in p.walk_packages(r.__path__, 'rolloutfleet.')]" \
    && ! /opt/rolloutfleet/bin/python -c "import rolloutfleet.sim" 2>/dev/null \
    && ! /opt/rolloutfleet/bin/python -c "import rolloutfleet.sandbox" 2>/dev/null \
    && ! /opt/rolloutfleet/bin/python -c "import rolloutfleet_worker" 2>/dev/null \
    && ! /opt/rolloutfleet/bin/python -c "import torch" 2>/dev/null \
    && ! /opt/rolloutfleet/bin/python -c "import kubernetes.aio" 2>/dev/null \
    && /opt/rolloutfleet/bin/python -c "import uvloop" \
    && /opt/rolloutfleet/bin/rolloutfleet run --help >/dev/null

FROM python:3.11-slim
LABEL org.opencontainers.image.title="rolloutfleet-operator" \
      org.opencontainers.image.description="Kubernetes operator for vLLM RL rollout fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/rolloutfleet /opt/rolloutfleet
ENV PATH=/opt/rolloutfleet/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp
# A numeric user so that `runAsNonRoot: true` can be verified by the kubelet without an /etc/passwd entry.
USER 65532:65532
WORKDIR /tmp
# 8080: Prometheus metrics (--metrics-port); 8081: kopf liveness endpoint (--liveness .../healthz).
EXPOSE 8080 8081
ENTRYPOINT ["rolloutfleet", "run"]
CMD ["--standalone"]
