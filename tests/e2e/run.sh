#!/usr/bin/env bash
# dracpu end-to-end tests on a real kind cluster (`just e2e`). See tests/e2e/README.md.
#
#   1. checks the prerequisites: kind, kubectl, docker (or podman) with a reachable engine,
#      cgroup v2, 4+ CPUs, the project's venv with pytest; exits 2 with a message if any is
#      missing, before it touches anything;
#   2. creates the kind cluster "dracpu-e2e" from tests/e2e/kind-config.yaml (NRI on in
#      containerd, DRAConsumableCapacity, kubelet cpuManagerPolicy none), with its own kubeconfig
#      (your ~/.kube/config is not touched);
#   3. builds the image dracpu:dev from Containerfile and loads it into the nodes;
#   4. deploys deploy/kustomize/overlays/kind and waits for the DaemonSet;
#   5. runs `pytest tests/e2e -m e2e` with DRACPU_E2E=1 (extra arguments go to pytest);
#   6. on failure, saves diagnostics (daemon logs, ResourceSlices, ResourceClaims, pods, events,
#      node logs) under the artifacts directory and prints the daemon logs' tail;
#   7. deletes the cluster, unless KEEP_CLUSTER=1.
#
# Environment:
#   KEEP_CLUSTER=1     keep the cluster afterwards (the script prints how to reach and delete it)
#   REUSE_CLUSTER=1    use an existing cluster of that name instead of failing (and keep it)
#   KIND_NODE_IMAGE    node image for every node instead of the pinned one in kind-config.yaml
#   CONTAINER_ENGINE   docker or podman (default: docker if present, else podman)
#   SKIP_BUILD=1       do not build the image; load the existing dracpu:dev
#   ARTIFACTS          directory for the kubeconfig and diagnostics (default: a new temp dir)
#   PYTHON             interpreter with pytest and the test dependencies (default: .venv/bin/python)
#   DRACPU_E2E_NODE    node the workload tests use (default: the first worker)
#
# Exit codes: 0 all tests passed; 2 prerequisites missing or the cluster could not be set up;
# otherwise pytest's code (1: tests failed).
set -euo pipefail

# Only shell builtins until the prerequisites are checked: this part must run (and explain
# itself) on a machine that has none of the tools, even with an empty PATH.
CLUSTER_NAME="dracpu-e2e"   # kind-config.yaml `name`; tests/test_e2e_assets.py checks they agree
IMAGE="dracpu:dev"          # deploy/kustomize/overlays/kind: image dracpu, newTag dev
KIND_MIN_VERSION="0.32.0"   # the release whose node image kind-config.yaml pins
MIN_CPUS=4                  # CPU 0 reserved + two exclusive claims + one shared CPU

say() { printf 'e2e: %s\n' "$*" >&2; }
die() {
  say "$*"
  exit 2
}

here="${BASH_SOURCE[0]}"
if [[ $here == */* ]]; then here="${here%/*}"; else here="."; fi
HERE="$(cd "$here" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

engine="${CONTAINER_ENGINE:-}"
if [[ -z $engine ]]; then
  if command -v docker >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null 2>&1; then
    engine=podman
  fi
fi
missing=()
[[ -n $engine ]] || missing+=("docker (or podman)")
[[ -z $engine ]] || command -v "$engine" >/dev/null 2>&1 || missing+=("$engine")
command -v kind >/dev/null 2>&1 || missing+=("kind")
command -v kubectl >/dev/null 2>&1 || missing+=("kubectl")
if ((${#missing[@]})); then
  list="${missing[0]}"
  for tool in "${missing[@]:1}"; do list+=", $tool"; done
  say "cannot run: not on PATH: $list."
  say "The kind e2e suite needs a container engine (Docker, or podman), kind >= v$KIND_MIN_VERSION"
  say "and kubectl. It creates a kind cluster with NRI enabled, deploys dracpu and asserts"
  say "Cpus_allowed_list inside pods; see tests/e2e/README.md. Nothing was run."
  exit 2
fi
case $engine in
  docker | podman) ;;
  *) die "CONTAINER_ENGINE=$engine: use docker or podman" ;;
esac
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x $PYTHON ]] || die "no Python at $PYTHON: run scripts/bootstrap dev, or set PYTHON"

# --- the tools exist: check that they work ---------------------------------------------------

"$engine" info >/dev/null 2>&1 || die "'$engine info' failed: is the $engine daemon running and reachable? (CONTAINER_ENGINE=docker|podman picks the engine)"
"$PYTHON" -c 'import pytest, yaml' 2>/dev/null || die "$PYTHON cannot import pytest and yaml: run scripts/bootstrap dev"
if [[ $engine == podman ]]; then
  export KIND_EXPERIMENTAL_PROVIDER="${KIND_EXPERIMENTAL_PROVIDER:-podman}"
  cgroups="$(podman info --format '{{.Host.CgroupsVersion}}' 2>/dev/null || true)"
  cpus="$(podman info --format '{{.Host.CPUs}}' 2>/dev/null || true)"
else
  cgroups="$(docker info --format '{{.CgroupVersion}}' 2>/dev/null || true)"
  cpus="$(docker info --format '{{.NCPU}}' 2>/dev/null || true)"
fi
case $cgroups in
  2 | v2) ;;
  *) die "the $engine host uses cgroup '${cgroups:-unknown}': kind node images of Kubernetes >= 1.35 need cgroup v2" ;;
esac
[[ $cpus =~ ^[0-9]+$ ]] || die "cannot tell how many CPUs the $engine host has ('$cpus')"
((cpus >= MIN_CPUS)) || die "the $engine host has $cpus CPUs; the suite needs $MIN_CPUS (CPU 0 is reserved)"

# version_ge A B: is dotted version A >= B (numeric parts, missing parts are 0)?
version_ge() {
  local -a a b
  local i
  IFS=. read -r -a a <<<"$1"
  IFS=. read -r -a b <<<"$2"
  for i in 0 1 2; do
    ((10#${a[i]:-0} > 10#${b[i]:-0})) && return 0
    ((10#${a[i]:-0} < 10#${b[i]:-0})) && return 1
  done
  return 0
}
kind_out="$(kind version 2>/dev/null || true)"
[[ $kind_out =~ v([0-9]+\.[0-9]+\.[0-9]+) ]] || die "cannot read the version from 'kind version': '$kind_out'"
kind_version="${BASH_REMATCH[1]}"
if ! version_ge "$kind_version" "$KIND_MIN_VERSION"; then
  if [[ -z ${KIND_NODE_IMAGE:-} ]]; then
    die "kind v$kind_version is older than v$KIND_MIN_VERSION, whose node image kind-config.yaml pins; upgrade kind or set KIND_NODE_IMAGE to an image built for your kind"
  fi
  say "warning: kind v$kind_version is older than v$KIND_MIN_VERSION; using KIND_NODE_IMAGE=$KIND_NODE_IMAGE"
fi

reuse=0
clusters="$(kind get clusters 2>/dev/null || true)"
while IFS= read -r line; do
  [[ $line == "$CLUSTER_NAME" ]] || continue
  [[ ${REUSE_CLUSTER:-0} == 1 ]] || die "a kind cluster named $CLUSTER_NAME exists: delete it (kind delete cluster --name $CLUSTER_NAME) or set REUSE_CLUSTER=1"
  reuse=1
done <<<"$clusters"

# --- set up ----------------------------------------------------------------------------------

ARTIFACTS="${ARTIFACTS:-$(mktemp -d "${TMPDIR:-/tmp}/dracpu-e2e.XXXXXX")}"
mkdir -p "$ARTIFACTS"
ARTIFACTS="$(cd "$ARTIFACTS" && pwd)"
export KUBECONFIG="$ARTIFACTS/kubeconfig"
say "artifacts and kubeconfig: $ARTIFACTS"

created=0
# shellcheck disable=SC2317 # called from the EXIT trap
dump_diagnostics() {
  local out="$ARTIFACTS/diagnostics"
  mkdir -p "$out"
  say "saving diagnostics to $out"
  kubectl get nodes -o wide >"$out/nodes.txt" 2>&1 || true
  kubectl get nodes -o yaml >"$out/nodes.yaml" 2>&1 || true
  kubectl get pods -A -o wide >"$out/pods.txt" 2>&1 || true
  kubectl -n dracpu describe daemonset,pods >"$out/dracpu-describe.txt" 2>&1 || true
  local pod
  for pod in $(kubectl -n dracpu get pods -o name 2>/dev/null); do
    kubectl -n dracpu logs "$pod" -c dracpu >"$out/${pod#pod/}.log" 2>&1 || true
    kubectl -n dracpu logs "$pod" -c dracpu --previous >"$out/${pod#pod/}.previous.log" 2>/dev/null || true
  done
  kubectl get resourceslices -o yaml >"$out/resourceslices.yaml" 2>&1 || true
  kubectl get resourceclaims -A -o yaml >"$out/resourceclaims.yaml" 2>&1 || true
  kubectl get deviceclasses -o yaml >"$out/deviceclasses.yaml" 2>&1 || true
  kubectl describe pods -A -l app.kubernetes.io/part-of=dracpu-e2e >"$out/e2e-pods.txt" 2>&1 || true
  kubectl get events -A --sort-by=.lastTimestamp >"$out/events.txt" 2>&1 || true
  kind export logs "$out/kind-logs" --name "$CLUSTER_NAME" >/dev/null 2>&1 || true
  local log
  for log in "$out"/dracpu-*.log; do
    [[ -s $log ]] || continue
    say "--- tail of $log"
    tail -n 60 "$log" >&2 || true
  done
}

# shellcheck disable=SC2317 # the EXIT trap
finish() {
  local rc=$?
  trap - EXIT
  if ((rc != 0)) && [[ -s $KUBECONFIG ]]; then
    dump_diagnostics
  fi
  if ((created)) && [[ ${KEEP_CLUSTER:-0} != 1 ]]; then
    say "deleting cluster $CLUSTER_NAME"
    kind delete cluster --name "$CLUSTER_NAME" >/dev/null 2>&1 || say "could not delete cluster $CLUSTER_NAME"
  elif [[ -s $KUBECONFIG ]]; then
    say "cluster $CLUSTER_NAME kept: export KUBECONFIG=$KUBECONFIG; delete it with: kind delete cluster --name $CLUSTER_NAME"
  fi
  if ((rc == 0)); then
    say "passed"
  else
    say "failed (exit $rc); artifacts in $ARTIFACTS"
  fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ((reuse)); then
  say "reusing cluster $CLUSTER_NAME"
  kind get kubeconfig --name "$CLUSTER_NAME" >"$KUBECONFIG" || die "cannot get the kubeconfig of $CLUSTER_NAME"
else
  created=1 # from here on a failure deletes the (maybe half-created) cluster
  say "creating kind cluster $CLUSTER_NAME"
  kind create cluster \
    --name "$CLUSTER_NAME" \
    --config "$HERE/kind-config.yaml" \
    --kubeconfig "$KUBECONFIG" \
    --wait 300s \
    ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} ||
    die "kind create cluster failed"
fi

# podman names an unqualified image localhost/...; the pods ask for dracpu:dev, which the
# runtime reads as docker.io/library/dracpu:dev, so podman builds that name.
image_ref="$IMAGE"
[[ $engine == podman ]] && image_ref="docker.io/library/$IMAGE"
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  # Build from a copy of the work tree without the venv, caches and git objects: the repository
  # has no .dockerignore, and the venv alone would be hundreds of MB of build context.
  context="$(mktemp -d "${TMPDIR:-/tmp}/dracpu-e2e-context.XXXXXX")"
  tar -C "$ROOT" -cf - \
    --exclude=./.git --exclude=./.venv --exclude=./.mypy_cache --exclude=./.ruff_cache \
    --exclude=./.pytest_cache --exclude=./.hypothesis --exclude=./.import_linter_cache \
    --exclude='__pycache__' . | tar -C "$context" -xf -
  say "building $image_ref from Containerfile with $engine"
  "$engine" build -t "$image_ref" -f "$context/Containerfile" "$context" || die "image build failed"
  rm -rf "$context"
fi
say "loading $image_ref into the nodes"
if [[ $engine == docker ]]; then
  kind load docker-image "$image_ref" --name "$CLUSTER_NAME" || die "kind load docker-image failed"
else
  podman save --format docker-archive -o "$ARTIFACTS/dracpu-image.tar" "$image_ref" || die "podman save failed"
  kind load image-archive "$ARTIFACTS/dracpu-image.tar" --name "$CLUSTER_NAME" || die "kind load image-archive failed"
fi

say "deploying deploy/kustomize/overlays/kind"
kubectl apply -k "$ROOT/deploy/kustomize/overlays/kind" || die "kubectl apply -k failed"
if ((reuse)); then
  # Same image tag as before: restart the pods so they run the image just loaded.
  kubectl -n dracpu rollout restart daemonset/dracpu || die "rollout restart failed"
fi
kubectl -n dracpu rollout status daemonset/dracpu --timeout=300s || die "the dracpu DaemonSet did not become ready"

say "running the e2e tests"
cd "$ROOT"
set +e
DRACPU_E2E=1 DRACPU_E2E_ARTIFACTS="$ARTIFACTS/tests" \
  "$PYTHON" -m pytest tests/e2e -m e2e -p no:cacheprovider -v --timeout=900 "$@"
rc=$?
set -e
exit "$rc"
