#!/usr/bin/env bash
# bench/rollout_overhead.py on the lent device (16 cores), so that the operator no longer shares 2 cores with the
# local control plane. The device has no Go and no internet: the control plane's binaries travel from this
# machine's cache (~/.cache/rolloutfleet/bin, ROLLOUTFLEET_CACHE overrides) as one xz archive split into parts of
# at most 40 MiB (a carry plus the ~7.5 MB tree must stay under 64 MiB per call, so one part per call), and the
# operator's runtime dependencies as cp312 manylinux wheels at exactly the versions of .venv (the device image's
# own packages are shadowed: PYTHONPATH puts /tmp/rfbench/site first). The device tool's `run` is a tool call,
# not a shell command, so this script is what each call runs, and `prepare` is what runs here once.
#
#   here, once:     scripts/bench/device-bench.sh prepare [--force]   (~2.5 min of xz on 2 cores; then ~1 s)
#   device call 1:  run  carry [".device-bench/1"]    command "bash scripts/bench/device-bench.sh unpack"
#   device call 2:  run  carry [".device-bench/2"]    command "bash scripts/bench/device-bench.sh unpack"
#   device call 3:  run  carry [".device-bench/whl"]  command "bash scripts/bench/device-bench.sh unpack && bash scripts/bench/device-bench.sh bench --sizes 64 256"
#   later calls:    run  (no carry)                   command "bash scripts/bench/device-bench.sh bench --sizes 1024"
#   longer than a call (one call is at most 10 minutes; 4,096 pods and more):
#                   run  command "bash scripts/bench/device-bench.sh start big --sizes 4096"   (returns at once)
#                   run  command "bash scripts/bench/device-bench.sh wait big"   (again until it says "ended")
#
# `start NAME ARGS` runs `bench ARGS` in the background (BENCH_TIMEOUT 1500 s unless set) into
# /tmp/rfbench/runs/NAME; `wait NAME [SECONDS]` returns once that run ended (its exit status, 0 or the bench's)
# or SECONDS passed (570 by default; then 75: call it again), prints its log's tail, and copies what it wrote
# into $OUT/NAME. It tells the end by the status file the run writes last, not by looking for the process (a
# hand-made `pgrep -f` loop matched its own command line and held the device for minutes after the run ended).
#
# That is the layout of December 2026 (the archive ~70 MB in two parts, the 40 wheels ~22 MB beside them);
# `prepare` prints the parts and the exact carry of each call for whatever it built. The parts may come in any
# order; `unpack` copies what a call carries into /tmp/rfbench (kept while the machine stays warm between
# calls), says what is still missing, and once all are there (checksums in the last binary part) extracts the
# binaries into /tmp/rfbench/cache/bin (the layout sandbox/binaries.py expects under
# ROLLOUTFLEET_CACHE=/tmp/rfbench/cache) and installs the wheels into /tmp/rfbench/site. On a cold machine
# (/tmp/rfbench gone: `bench` says "not unpacked") carry the parts again. The wheels ride in the last binary
# part's whl/ when both fit in 40 MiB, else in .device-bench/whl (one more call).
#
# `bench ARGS` runs `python3 bench/rollout_overhead.py ARGS` (ARGS as its argparse takes them, e.g. --sizes 64
# --scenarios uniform-allatonce-sleep) with --out/--json into $OUT when set (the device tool brings $OUT back),
# its log in $OUT/bench.log and, when it fails, the operator's and followers' log tails in
# $OUT/failure-logs.txt; under `timeout -s INT` (BENCH_TIMEOUT, default 560 s: one call is at most 10 minutes;
# SIGINT lets the bench stop its cluster and write the partial report). 64 pods take under a minute here.
# The bench serves the engines from half the cores' worth of follower processes (8 here): one process serving
# 1,024 engines answered late and inflated the walls measured before 2026-12-03's last session by 2-3 s.
# The operator and the followers are started with sys.executable and inherit PYTHONPATH, so no console script
# or .venv is needed, and no Go: binaries.ensure() asks for it only when a binary is missing. --profile does not
# work on the device once py-spy's static binary is carried too: `mkdir -p .device-bench/spy && cp
# .venv/bin/py-spy .device-bench/spy/` here (after `.venv/bin/pip install py-spy`), then one call with carry
# [".device-bench/spy"] and `unpack`; `bench` puts it on PATH, where the bench looks after beside python3.
# PY (default python3) is the interpreter of `unpack`'s pip step and of `bench`; the local rehearsal sets it to
# a bare CPython 3.12 venv. VENV_PY (default .venv/bin/python) is what `prepare` reads the pinned versions from.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
PY=${PY:-python3}
VENV_PY=${VENV_PY:-$repo/.venv/bin/python}
carry=.device-bench               # here: the parts, each a carry; ignored through .git/info/exclude
state=${RFBENCH_STATE:-/tmp/rfbench}  # on the device (RFBENCH_STATE: the tests' own directory)
part_max=$((40 * 1024 * 1024))    # 40 MiB per carried part
target_py=3.12
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

# -- here --------------------------------------------------------------------------------------------------------

# The control plane's files that the bench's cluster needs (cluster.COMPONENTS: binaries and assets such as kwok's
# stages.yaml), relative to the cache root; first line: the cache root. Versions come from binaries.py itself.
control_plane_files() {
  PYTHONPATH=$repo/operator "$VENV_PY" - <<'EOF'
from rolloutfleet.sandbox import binaries, cluster
root = binaries.cache_root()
print(root)
for name in cluster.COMPONENTS:
    tool = binaries.TOOLS[name]
    for path in [binaries.binary_path(name), *(binaries.asset_path(name, asset) for asset, _ in tool.assets)]:
        print(path.relative_to(root))
EOF
}

# NAME==VERSION of every runtime dependency of the root project, transitively, as installed in .venv; markers
# evaluated for CPython 3.12 on Linux x86_64. rolloutfleet-digest is left out (its wheel is built from ./digest)
# but its own dependencies are followed.
runtime_requirements() {
  "$VENV_PY" - "$target_py" <<'EOF'
import importlib.metadata as md
import re
import sys

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

env = {
    "python_version": sys.argv[1], "python_full_version": sys.argv[1] + ".0", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix",
}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
local = {"rolloutfleet", "rolloutfleet-digest"}
seen, pinned, todo, missing = set(), {}, [("rolloutfleet", frozenset())], []
while todo:
    name, extras = todo.pop()
    key = (norm(name), extras)
    if key in seen:
        continue
    seen.add(key)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        missing.append(name)
        continue
    if norm(name) not in local:
        pinned[norm(dist.metadata["Name"])] = f"{dist.metadata['Name']}=={dist.version}"
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not any(
            req.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""})
        ):
            continue
        todo.append((req.name, frozenset(req.extras)))
if missing:
    sys.exit(f"not installed in .venv: {', '.join(sorted(set(missing)))}")
print("\n".join(pinned[k] for k in sorted(pinned)))
EOF
}

download_wheels() {  # download_wheels DIR REQUIREMENTS_FILE
  local dir=$1 reqs=$2 base=(--no-deps --only-binary=:all: --python-version "$target_py" --implementation cp)
  local plats=() p
  for p in "${platforms[@]}"; do plats+=(--platform "$p"); done
  if python3 -m pip download -q "${base[@]}" "${plats[@]}" -d "$dir" -r "$reqs"; then return 0; fi
  # One at a time, so that a wheel built for a newer glibc only is looked for with more manylinux_2_N tags.
  local req more=()
  for p in 35 34 33 32 31 30 29; do more+=(--platform "manylinux_2_${p}_x86_64"); done
  while read -r req; do
    python3 -m pip download -q "${base[@]}" "${plats[@]}" -d "$dir" "$req" 2>/dev/null && continue
    echo "  $req: no wheel for manylinux_2_28 or older; trying manylinux_2_29..2_35" >&2
    python3 -m pip download -q "${base[@]}" "${plats[@]}" "${more[@]}" -d "$dir" "$req"
  done < "$reqs"
}

prepare() {
  local force=0
  [ "${1:-}" = --force ] && force=1
  mkdir -p .git/info
  grep -qx '/.device-bench/' .git/info/exclude 2>/dev/null || echo '/.device-bench/' >> .git/info/exclude
  mkdir -p "$carry"
  rm -rf "$carry"/.pack.* "$carry"/.whl.*   # what an interrupted run left

  # 1. The binaries: one archive, split; rebuilt only when the inputs' names, sizes or mtimes changed.
  local listing root files=() f inputs
  listing=$(control_plane_files)
  root=$(head -1 <<< "$listing")
  mapfile -t files < <(tail -n +2 <<< "$listing")
  for f in "${files[@]}"; do
    [ -f "$root/$f" ] || { echo "missing $root/$f: build it first (.venv/bin/rolloutfleet sandbox build)" >&2; exit 1; }
  done
  inputs=$(cd "$root" && stat -c '%n %s %Y' "${files[@]}"; echo "xz -6 split $part_max")
  local old_parts=()
  mapfile -t old_parts < <(cat "$carry"/*/cp-bin.parts 2>/dev/null || true)
  local complete=$((${#old_parts[@]} > 0))
  for f in "${old_parts[@]}"; do [ -f "$carry/$(part_index "$f")/$f" ] || complete=0; done
  if [ "$force" = 1 ] || [ "$complete" = 0 ] || [ "$inputs" != "$(cat "$carry/cp-bin.inputs" 2>/dev/null)" ]; then
    echo "packing ${#files[@]} files from $root (xz -T2 -6; a few minutes on 2 cores)"
    for f in "$carry"/[0-9]*/whl; do  # keep the wheels (placed again below)
      [ -d "$f" ] && { rm -rf "$carry/whl"; mv "$f" "$carry/whl"; }
    done
    rm -rf "$carry"/[0-9]* "$carry/cp-bin.inputs"
    local tmp
    tmp=$(mktemp -d "$carry/.pack.XXXXXX")
    tar --owner=0 --group=0 --numeric-owner -C "$root" -cf - "${files[@]}" | xz -T2 -6 > "$tmp/cp-bin.tar.xz"
    split -b "$part_max" -d -a 2 "$tmp/cp-bin.tar.xz" "$tmp/piece."
    local pieces=("$tmp"/piece.*) n i=0 name
    n=${#pieces[@]}
    (cd "$tmp" && sha256sum cp-bin.tar.xz > whole.sha256)
    : > "$tmp/parts.sha256"
    for f in "${pieces[@]}"; do
      i=$((i + 1))
      name=cp-bin.tar.xz.part${i}of${n}
      mkdir -p "$carry/$i"
      mv "$f" "$carry/$i/$name"
      (cd "$carry/$i" && sha256sum "$name") >> "$tmp/parts.sha256"
      echo "$name" >> "$tmp/cp-bin.parts"
    done
    # The last part carries the checksums (each part's and the whole archive's) and the list of parts.
    cat "$tmp/parts.sha256" "$tmp/whole.sha256" > "$carry/$n/cp-bin.sha256"
    mv "$tmp/cp-bin.parts" "$carry/$n/cp-bin.parts"
    rm -rf "$tmp"
    echo "$inputs" > "$carry/cp-bin.inputs"
  else
    echo "binaries: parts up to date (prepare --force repacks)"
  fi
  local nparts last
  nparts=$(wc -l < "$(ls "$carry"/*/cp-bin.parts)")
  last=$carry/$nparts

  # 2. The wheels: requirements from .venv, downloaded for cp312 manylinux x86_64, plus the digest's wheel.
  local reqs stamp current wdir=""
  reqs=$(runtime_requirements)
  stamp=$(echo "$reqs"; cd digest && find . -path ./build -prune -o -name '*.egg-info' -prune -o -name __pycache__ \
    -prune -o -type f -printf '%p %s %T@\n' | sort)
  for current in "$last/whl" "$carry/whl"; do [ -f "$current/SHA256SUMS" ] && wdir=$current; done
  if [ "$force" = 1 ] || [ -z "$wdir" ] || [ "$stamp" != "$(cat "$carry/whl.inputs" 2>/dev/null)" ] \
      || ! (cd "$wdir" && sha256sum --quiet -c SHA256SUMS); then
    echo "downloading $(wc -l <<< "$reqs") wheels for CPython $target_py manylinux x86_64; building the digest's"
    rm -rf "$last/whl" "$carry/whl" "$carry/whl.inputs"
    local tmp
    tmp=$(mktemp -d "$carry/.whl.XXXXXX")
    echo "$reqs" > "$tmp/requirements.txt"
    mkdir "$tmp/whl"
    download_wheels "$tmp/whl" "$tmp/requirements.txt"
    # From a copy of digest/, so that the build leaves no build/ or egg-info behind in the tree.
    mkdir "$tmp/src"
    tar -C digest --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$tmp/src" -xf -
    python3 -m pip wheel -q --no-deps -w "$tmp/whl" "$tmp/src"
    mv "$tmp/requirements.txt" "$tmp/whl/"
    (cd "$tmp/whl" && sha256sum ./*.whl | sed 's| \./| |' > SHA256SUMS)
    wdir=$carry/whl
    mv "$tmp/whl" "$wdir"
    rm -rf "$tmp"
    echo "$stamp" > "$carry/whl.inputs"
  else
    echo "wheels: up to date"
  fi
  # Into the last part when both fit under 40 MiB together, else a carry of their own.
  local want=$carry/whl
  if [ $(($(bytes "$last" whl) + $(bytes "$wdir"))) -le "$part_max" ]; then
    want=$last/whl
  fi
  [ "$wdir" = "$want" ] || { rm -rf "$want"; mv "$wdir" "$want"; }

  echo
  echo "parts (each at most $part_max bytes of files):"
  local d
  for d in "$carry"/[0-9]* "$carry/whl"; do
    [ -d "$d" ] || continue
    printf '  %-18s %10s bytes  %s\n' "$d" "$(bytes "$d")" \
      "$(cd "$d" && ls -d cp-bin.* whl 2>/dev/null | tr '\n' ' ')$(ls "$d" | grep -c '\.whl$' | sed 's/^0$//; s/.\+/& wheels/')"
  done
  echo "wheels ($(grep -c . "$want/SHA256SUMS") in $want):"
  sed 's/^/  /' "$want/requirements.txt"
  echo
  echo "device calls (the parts in any order; each within the warm period of the one before):"
  local i
  for i in $(seq 1 "$nparts"); do
    echo "  run  carry [\"$carry/$i\"]  command \"bash scripts/bench/device-bench.sh unpack\""
  done
  [ "$want" = "$carry/whl" ] && echo "  run  carry [\"$carry/whl\"]  command \"bash scripts/bench/device-bench.sh unpack\""
  echo "  then: run (no carry) command \"bash scripts/bench/device-bench.sh bench --sizes 64 256\" (or chain it to the last unpack with &&)"
}

bytes() {  # bytes DIR [EXCLUDED_SUBDIR]: the sizes of its files, added up (what a carry moves)
  find "$1" ${2:+-path "$1/$2" -prune -o} -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}'
}

part_index() {  # cp-bin.tar.xz.part2of3 -> 2
  local s=${1#cp-bin.tar.xz.part}
  echo "${s%of*}"
}

# -- on the device -----------------------------------------------------------------------------------------------

install_wheels() {  # install_wheels WHEEL...
  if "$PY" -m pip --version > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$state/site" "$@"
  else  # an interpreter without pip: a wheel is a zip; its .data/{purelib,platlib} belong at the top
    echo "($PY has no pip: unzipping the wheels)"
    "$PY" - "$state/site" "$@" <<'EOF'
import pathlib, shutil, sys, zipfile
site = pathlib.Path(sys.argv[1])
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
for data in site.glob("*.data"):
    for kind in ("purelib", "platlib"):
        if (data / kind).is_dir():
            shutil.copytree(data / kind, site, dirs_exist_ok=True)
    shutil.rmtree(data)
EOF
  fi
}

unpack() {
  mkdir -p "$state/parts" "$state/whl" "$state/cache"
  local d f got=()
  for d in "$carry"/*/; do
    d=${d%/}
    [ -d "$d" ] || continue
    if [ "$(basename "$d")" = whl ]; then cp -p "$d"/* "$state/whl/"; got+=("$d"); continue; fi
    if [ "$(basename "$d")" = spy ]; then  # py-spy's static binary, for --profile (`bench` puts it on PATH)
      mkdir -p "$state/bin" && cp -p "$d/py-spy" "$state/bin/" && got+=("$d"); continue
    fi
    for f in "$d"/cp-bin.*; do [ -f "$f" ] && cp -p "$f" "$state/parts/"; done
    [ -d "$d/whl" ] && cp -p "$d"/whl/* "$state/whl/"
    got+=("$d")
  done
  echo "this call carried: ${got[*]:-nothing}"
  cd "$state/parts"
  local have=(cp-bin.tar.xz.part*) total=""
  [ -e "${have[0]}" ] || have=()
  [ ${#have[@]} -gt 0 ] && total=${have[0]##*of}
  echo "binary parts here: ${have[*]:-none}${total:+ (of $total)}"
  local missing=()
  if [ -f cp-bin.parts ]; then  # the last part is here: its list and checksums decide
    while read -r f; do
      if [ ! -f "$f" ]; then missing+=("$carry/$(part_index "$f")")
      elif ! grep " $f\$" cp-bin.sha256 | sha256sum --quiet -c -; then
        echo "$f: checksum mismatch (from another prepare run?): carry it again" >&2
        rm -f "$f"
        missing+=("$carry/$(part_index "$f")")
      fi
    done < cp-bin.parts
  elif [ -n "$total" ]; then
    local i
    for i in $(seq 1 "$total"); do [ -f "cp-bin.tar.xz.part${i}of${total}" ] || missing+=("$carry/$i"); done
  else
    missing+=("every binary part")
  fi
  [ -f "$state/whl/SHA256SUMS" ] || missing+=("the wheels (whl/ of the last part, or .device-bench/whl)")
  if [ ${#missing[@]} -gt 0 ]; then
    echo "still missing: ${missing[*]}"
    echo "not ready: carry the missing parts in further calls of 'unpack'"
    return 0
  fi
  cd "$repo"

  local whole
  whole=$(grep ' cp-bin.tar.xz$' "$state/parts/cp-bin.sha256" | cut -d' ' -f1)
  if [ "$(cat "$state/cache/.cp-bin.sha256" 2>/dev/null)" != "$whole" ]; then
    echo "joining and checking the archive; extracting into $state/cache"
    (cd "$state/parts" && mapfile -t order < cp-bin.parts && cat "${order[@]}" > cp-bin.tar.xz \
      && grep ' cp-bin.tar.xz$' cp-bin.sha256 | sha256sum -c -)
    rm -rf "$state/cache/bin"
    if command -v xz > /dev/null; then
      xz -dc "$state/parts/cp-bin.tar.xz" | tar -x -C "$state/cache"
    else
      "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' \
        "$state/parts/cp-bin.tar.xz" "$state/cache"
    fi
    rm -f "$state/parts/cp-bin.tar.xz"
    echo "$whole" > "$state/cache/.cp-bin.sha256"
  else
    echo "binaries: already extracted ($whole)"
  fi

  (cd "$state/whl" && sha256sum --quiet -c SHA256SUMS)
  local sums
  sums=$(sha256sum "$state/whl/SHA256SUMS" | cut -d' ' -f1)
  if [ "$(cat "$state/site/.wheels.sha256" 2>/dev/null)" != "$sums" ]; then
    echo "installing $(grep -c . "$state/whl/SHA256SUMS") wheels into $state/site with $("$PY" --version 2>&1)"
    rm -rf "$state/site"
    mkdir -p "$state/site"
    local wheels=()
    mapfile -t wheels < <(awk -v d="$state/whl" '{print d "/" $2}' "$state/whl/SHA256SUMS")
    install_wheels "${wheels[@]}"
    echo "$sums" > "$state/site/.wheels.sha256"
  else
    echo "wheels: already installed"
  fi

  environment
  # Everything the bench's cluster starts, as sandbox/binaries.py sees it, and whether each one runs here.
  "$PY" - <<'EOF'
from rolloutfleet.sandbox import binaries, cluster
bad = [n for n in cluster.COMPONENTS if not binaries._complete(binaries.TOOLS[n])]
for n in cluster.COMPONENTS:
    print(f"  {n:24} {binaries.binary_path(n)}")
raise SystemExit(f"incomplete under {binaries.cache_root()}: {bad}" if bad else 0)
EOF
  local b v
  for b in "$state"/cache/bin/*/*; do
    [ -x "$b" ] && [ -f "$b" ] || continue
    v=$("$b" --version 2>&1) || v="(--version failed) $v"
    printf '  %-24s %s\n' "$(basename "$b")" "${v%%$'\n'*}"
  done
  date -u +%FT%TZ > "$state/ready"
  echo "ready: bash scripts/bench/device-bench.sh bench ARGS"
}

environment() {
  export ROLLOUTFLEET_CACHE=$state/cache
  # RF_OPERATOR: another operator tree to measure (side by side with this one: e.g. `git archive REV operator`
  # unpacked into a carried .device-bench/base; its simulator serves the engines too).
  export PYTHONPATH=$state/site:${RF_OPERATOR:-$repo/operator}
  export PATH=$state/bin:$PATH  # a carried py-spy (unpack), found by the bench's --profile
  export PYTHONUNBUFFERED=1
}

# `bench` and `start` need every part unpacked (`unpack` writes $state/ready last).
need_unpacked() {
  [ -f "$state/ready" ] || { echo "not unpacked: run 'unpack' with every part first ($state/ready missing)" >&2; exit 1; }
}

bench() {
  need_unpacked
  environment
  local args=("$@") a has_out=0 has_json=0 log=$state/bench.log
  for a in "${args[@]}"; do
    case "$a" in --out|--out=*) has_out=1 ;; --json|--json=*) has_json=1 ;; esac
  done
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    log=$OUT/bench.log
    [ "$has_out" = 1 ] || args+=(--out "$OUT/rollout_overhead.md")
    [ "$has_json" = 1 ] || args+=(--json "$OUT/rollout_overhead.json")
  fi
  local rc=0
  touch "$state/bench.started"
  {
    echo "# $(date -u +%FT%TZ) scripts/bench/device-bench.sh bench ${args[*]}"
    echo "nproc: $(nproc)"
    echo "cpu: $( (lscpu 2>/dev/null | sed -n 's/^Model name: *//p'; grep -m1 '^model name' /proc/cpuinfo | sed 's/.*: //') | head -1)"
    echo "memory: $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
    echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PY" -c 'import importlib.metadata as md, kopf, rolloutfleet
names = ("kopf", "kubernetes", "aiohttp", "pydantic", "cryptography", "msgspec")
print("operator from", rolloutfleet.__file__.rsplit("/", 2)[0] + ", packages from", kopf.__file__.rsplit("/", 2)[0])
print("versions:", ", ".join(f"{n} {md.version(n)}" for n in names))' || true
    echo "\$ $PY bench/rollout_overhead.py ${args[*]}"
  } 2>&1 | tee "$log"
  timeout -s INT -k 60 "${BENCH_TIMEOUT:-560}" "$PY" bench/rollout_overhead.py "${args[@]}" 2>&1 | tee -a "$log" \
    || rc=$?
  echo "bench rc=$rc" | tee -a "$log"
  if [ "$rc" != 0 ] && [ -n "${OUT:-}" ]; then  # the operator's and followers' logs, for the post-mortem
    find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'rf-bench-*.log' -newer "$state/bench.started" | sort \
      | while read -r f; do echo "=== $f (last 200 lines)"; tail -200 "$f"; done > "$OUT/failure-logs.txt" 2>&1 || true
  fi
  return "$rc"
}

# A run in the background, for benches longer than one device call (the header's "longer than a call").
start() {
  local name=${1:-}
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "start NAME ARGS: NAME of letters, digits, '.', '_' or '-'" >&2; exit 2; }
  shift
  need_unpacked
  local dir=$state/runs/$name
  if [ -f "$dir.pid" ] && [ ! -f "$dir.rc" ] && kill -0 "$(cat "$dir.pid")" 2>/dev/null; then
    echo "run $name is still going (pid $(cat "$dir.pid")): wait $name" >&2
    exit 1
  fi
  rm -rf "$dir" "$dir.rc" "$dir.pid" "$dir.out"
  mkdir -p "$dir"
  # setsid: the run outlives the call that started it. The status file is written last, once the bench ended.
  RFB_DIR=$dir BENCH_TIMEOUT=${BENCH_TIMEOUT:-1500} setsid nohup bash -c \
    'rc=0; OUT=$RFB_DIR bash "$0" bench "$@" > "$RFB_DIR.out" 2>&1 || rc=$?; echo "$rc" > "$RFB_DIR.rc"' \
    "$repo/scripts/bench/device-bench.sh" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$dir.pid"
  echo "started $name (pid $!); then: bash scripts/bench/device-bench.sh wait $name"
}

wait_run() {
  local name=${1:-} limit=${2:-570} waited=0
  local dir=$state/runs/$name
  [ -n "$name" ] && [ -f "$dir.pid" ] || { echo "no run named '$name' (start NAME ARGS starts one)" >&2; exit 2; }
  while [ ! -f "$dir.rc" ] && [ "$waited" -lt "$limit" ] && kill -0 "$(cat "$dir.pid")" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
  done
  tail -n 20 "$dir/bench.log" 2>/dev/null || tail -n 20 "$dir.out" 2>/dev/null || true
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/$name"
    cp -r "$dir/." "$OUT/$name/"
  fi
  if [ -f "$dir.rc" ]; then
    local rc
    rc=$(cat "$dir.rc")
    echo "run $name ended: rc=$rc"
    return "$rc"
  fi
  if ! kill -0 "$(cat "$dir.pid")" 2>/dev/null; then
    echo "run $name is gone without an exit status (killed?): see $dir.out" >&2
    return 1
  fi
  echo "run $name still going after ${limit}s: wait $name again"
  return 75
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  unpack) unpack ;;
  bench) shift; bench "$@" ;;
  start) shift; start "$@" ;;
  wait) shift; wait_run "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
