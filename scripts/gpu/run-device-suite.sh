#!/usr/bin/env bash
# The GPU tier on the lent H200, in one go (docs/gpu.md). vLLM 0.26.0 travels as two carries
# (../shared/gpu/README.md); the device tool's `run` is a tool call, not a shell command, so this script
# is what each call runs, and `prepare` is what runs here once.
#
#   here, once:      scripts/gpu/run-device-suite.sh prepare
#   device call 1:   run  carry [".device-carry/1"]          command "bash scripts/gpu/run-device-suite.sh stage1"
#   device call 1b:  run  carry [".device-carry/3"]          command "bash scripts/gpu/run-device-suite.sh stage1"
#   device call 2:   run  carry [".device-carry/2", ".whl"]  command "bash scripts/gpu/run-device-suite.sh stage2 suite"
#
# Three parts since the working tree passed 4 MB: a carry plus the tree must stay under 64 MiB per call, and
# the 60 MiB halves of the two-part recipe left no room ("prepare" re-splits them into three of ~40 MiB).
#   device call 3:   run  carry [".whl"]                     command "bash scripts/gpu/run-device-suite.sh stage2 bench"
#   pushes:          run  carry [".device-carry/2", ".whl"]  command "bash scripts/gpu/run-device-suite.sh stage2 transfer push"
#
# Call 2 must start within 30 s of call 1 (the machine stays warm that long); call 3 likewise after call 2
# (it finds /tmp/site there and skips the unpacking; on a cold machine repeat calls 1 and 2 with "bench").
# Parts: suite (tests/gpu, which also runs tests/contract against the real server), bench
# (bench/gpu_update.py), loader (bench/loader_stages.py alone: the loader's stages and its
# switches, no vLLM, ~1 min), transfer (tests/contract/test_transfer_contract.py against an IPC-backend
# server and a plain one: scripts/gpu/contract_transfer.py, ~2.5 min), push (bench/gpu_push.py: the 3.49 GB
# model pushed by IPC vs loaded by path, ~2.5 min), proof (scripts/gpu/push_proof.py with PROOF_ARGS: pushes
# through the operator's planner, IPC or NCCL), all (suite + bench; may not fit one 10-minute call).
# Several parts run in order: "stage2 transfer push". Results go to $OUT (the
# device tool brings them back; at most 8 files), else to bench/results/gpu-run.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
out=${OUT:-$repo/bench/results/gpu-run}

prepare() {
  grep -qx '/.device-carry/' .git/info/exclude || echo '/.device-carry/' >> .git/info/exclude
  grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  if [ ! -f .device-carry/2/vllm026-site.sha256 ]; then
    ../shared/gpu/build-vllm-carry.sh .device-carry   # ~5 min of CPU
  fi
  if [ ! -d .device-carry/3 ]; then   # two ~60 MiB parts → three ~40 MiB parts (same archive, same checksum)
    tmp=$(mktemp -d)
    cat .device-carry/1/vllm026-site.tar.xz.part-* .device-carry/2/vllm026-site.tar.xz.part-* > "$tmp/whole"
    rm -f .device-carry/1/vllm026-site.tar.xz.part-* .device-carry/2/vllm026-site.tar.xz.part-*
    mkdir -p .device-carry/3
    split -b 40M -d -a 1 "$tmp/whole" "$tmp/vllm026-site.tar.xz.part-"
    mv "$tmp/vllm026-site.tar.xz.part-0" .device-carry/1/
    mv "$tmp/vllm026-site.tar.xz.part-1" .device-carry/3/
    mv "$tmp/vllm026-site.tar.xz.part-2" .device-carry/2/
    rm -rf "$tmp"
  fi
  # pytest-asyncio is not on the device image; pytest itself only if the image's is older than 8.4.
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
    pytest-asyncio==1.5.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
  # The worker and digest wheels, built exactly as for worker_image/Dockerfile: the device installs these,
  # not the source tree, so the GPU proof covers what the image ships. Rebuilt every time (seconds) so
  # they always match the tree; run `prepare` again after changing worker_image/ or digest/.
  rm -f .whl/rolloutfleet_*.whl
  python3 -m pip wheel -q --no-deps -w .whl ./digest ./worker_image
  ls -l .device-carry/1 .device-carry/2 .whl
}

stage1() {
  # Whichever part this call carries (.device-carry/1, then .device-carry/3).
  mkdir -p /tmp/vc && cp .device-carry/[13]/* /tmp/vc/ 2>/dev/null; ls /tmp/vc
}

unpack() {
  if [ ! -d /tmp/site/vllm ]; then
    mkdir -p /tmp/vc /tmp/site && cp .device-carry/2/* /tmp/vc/
    (cd /tmp/vc && cat vllm026-site.tar.xz.part-? > vllm026-site.tar.xz && sha256sum -c vllm026-site.sha256)
    xz -dc /tmp/vc/vllm026-site.tar.xz | tar -x -C /tmp/site
  fi
  mkdir -p /tmp/site-extra
  # The worker package as the image installs it (pip --no-deps from its wheels), fresh on every call.
  rm -rf /tmp/site-worker
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-worker \
    .whl/rolloutfleet_digest-*.whl .whl/rolloutfleet_worker-*.whl
  if ! python3 -c 'import pytest_asyncio' 2>/dev/null && [ ! -d /tmp/site-extra/pytest_asyncio ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-extra .whl/pytest_asyncio-*.whl
    if python3 -c 'import pytest,sys; sys.exit(tuple(map(int, pytest.__version__.split(".")[:2])) >= (8, 4))'; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-extra \
        .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl
    fi
  fi
}

environment() {
  # The operator's source (the tests drive its planner and executor) but not worker_image/ or digest/:
  # the engines and the tests import those from the installed wheels (tests/gpu/gpu_support.py strips the
  # operator's tree from the engines' PYTHONPATH and records where each server imported the worker from).
  export PYTHONPATH=/tmp/site-extra:/tmp/site-worker:/tmp/site:$repo/operator
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export PYTHONUNBUFFERED=1
}

suite() {
  mkdir -p "$out"
  {
    echo "# $(date -u +%FT%TZ) scripts/gpu/run-device-suite.sh stage2 suite"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    python3 -c 'import torch, vllm, transformers, pytest; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "pytest", pytest.__version__)'
    echo "\$ python3 -m pytest ${SUITE_TESTS:-tests/gpu} -m gpu -rA -p no:cacheprovider"
  } > "$out/suite.log" 2>&1
  # SUITE_TESTS: a subset, e.g. tests/gpu/test_06_eagle3.py (its own server only).
  # shellcheck disable=SC2086
  ROLLOUTFLEET_GPU_RESULTS=$out timeout "${SUITE_TIMEOUT:-540}" \
    python3 -m pytest ${SUITE_TESTS:-tests/gpu} -m gpu -rA -p no:cacheprovider --timeout 150 >> "$out/suite.log" 2>&1 || echo "suite rc=$?" | tee -a "$out/suite.log"
  tail -40 "$out/suite.log"
}

bench() {
  mkdir -p "$out"
  timeout "${BENCH_TIMEOUT:-540}" python3 bench/gpu_update.py --out "$out" > "$out/bench.log" 2>&1 \
    || echo "bench rc=$?" | tee -a "$out/bench.log"
  tail -30 "$out/bench.log"
  cat "$out/gpu_update.md" 2>/dev/null || true
}

transfer() {
  mkdir -p "$out"
  # shellcheck disable=SC2086
  timeout "${TRANSFER_TIMEOUT:-300}" python3 scripts/gpu/contract_transfer.py --out "$out" ${TRANSFER_ARGS:-} > "$out/transfer.log" 2>&1 \
    || echo "transfer rc=$?" | tee -a "$out/transfer.log"
  tail -40 "$out/transfer.log"
}

push() {
  mkdir -p "$out"
  timeout "${PUSH_TIMEOUT:-330}" python3 bench/gpu_push.py --out "$out" > "$out/push.log" 2>&1 \
    || echo "push rc=$?" | tee -a "$out/push.log"
  tail -25 "$out/push.log"
  cat "$out/push.md" 2>/dev/null | head -20 || true
}

proof() {
  mkdir -p "$out"
  # scripts/gpu/push_proof.py: pushed revisions through the operator's planner and executor (PROOF_ARGS, e.g.
  # "--backend nccl --parts stale,cycles,abandon"); the engines load the worker from the wheels.
  # shellcheck disable=SC2086
  timeout "${PROOF_TIMEOUT:-560}" python3 scripts/gpu/push_proof.py --out "$out" ${PROOF_ARGS:-} > "$out/push-proof.log" 2>&1 \
    || echo "proof rc=$?" | tee -a "$out/push-proof.log"
  grep -E "^(PASS|FAIL|==|[0-9]+/[0-9]+ checks)" "$out/push-proof.log" | tail -60
  tail -5 "$out/push-proof.log"
}

loader() {
  mkdir -p "$out"
  timeout "${LOADER_TIMEOUT:-300}" python3 bench/loader_stages.py --out "$out" > "$out/loader.log" 2>&1 \
    || echo "loader rc=$?" | tee -a "$out/loader.log"
  tail -45 "$out/loader.log"
}

case "${1:-}" in
  prepare) prepare ;;
  stage1) stage1 ;;
  stage2)
    unpack
    environment
    shift
    for part in "${@:-suite}"; do
      case "$part" in
        suite) suite ;;
        bench) bench ;;
        loader) loader ;;
        transfer) transfer ;;
        push) push ;;
        proof) proof ;;
        all) suite; bench ;;
        *) echo "unknown part: $part" >&2; exit 2 ;;
      esac
    done
    ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
