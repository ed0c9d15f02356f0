# dracpu developer recipes. `just` itself is installed into .venv by `scripts/bootstrap dev`
# (PyPI package rust-just); run `.venv/bin/just <recipe>` or put .venv/bin on PATH.

set shell := ["bash", "-euo", "pipefail", "-c"]

venv := justfile_directory() / ".venv/bin"

# list the recipes
default:
    @just --list

# everything CI runs: lint, types, layering, generated code, tests
test *ARGS:
    scripts/test {{ARGS}}

# the optional external peers some tests use, from Debian (they skip, saying why, without them):
# podman (a real CDI consumer) and shellcheck (the e2e scripts); the grpc-go peer is built from
# its Go module (tests/peers_go/grpc_client) with the go on PATH
[doc("install from Debian the optional peers some tests use: podman, shellcheck")]
peers:
    apt-get install -y podman runc busybox-static shellcheck

# regenerate requirements/*.lock from pyproject.toml: pinned, hashed, for Python 3.11 on any
# platform; the current pins are kept unless ARGS say otherwise (e.g. --upgrade-package NAME)
[doc("regenerate requirements/*.lock from pyproject.toml (pins kept unless ARGS say otherwise)")]
lock *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    compile() { {{venv}}/uv pip compile --universal --python-version 3.11 --generate-hashes \
        --custom-compile-command "just lock" --quiet {{ARGS}} "$@"; }
    # the dev lock is the superset; the others take its pins (-c), so all agree
    compile pyproject.toml --extra dev -o requirements/dev.lock
    compile pyproject.toml -c requirements/dev.lock -o requirements/runtime.lock
    compile pyproject.toml --extra sim -c requirements/dev.lock -o requirements/sim.lock
    # the build backend of the image's wheel (pyproject [build-system] requires)
    {{venv}}/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")' \
        | compile - -c requirements/dev.lock -o requirements/build.lock

# run the pre-commit hooks (.pre-commit-config.yaml) on every file; `just hooks install` sets
# them up for each commit
[doc("run the pre-commit hooks on every file; `just hooks install`: at each commit")]
hooks *ARGS="run --all-files":
    {{venv}}/pre-commit {{ARGS}}

# ruff lint and format check
lint:
    {{venv}}/ruff check src tests bench scripts
    {{venv}}/ruff format --check src tests bench scripts

# apply ruff's fixes and formatting
fmt:
    {{venv}}/ruff check --fix src tests bench scripts
    {{venv}}/ruff format src tests bench scripts

# mypy --strict over src, tests and bench
typecheck:
    {{venv}}/mypy

# the import-layering contracts (pyproject [tool.importlinter])
layers:
    {{venv}}/lint-imports

# regenerate src/dracpu/_gen from proto/ (betterproto2 + grpclib stubs)
proto:
    {{venv}}/python scripts/gen_proto.py

# fail when src/dracpu/_gen is stale
proto-check:
    {{venv}}/python scripts/gen_proto.py --check

# rewrite the table of every setting in docs/upstream-compatibility.md from the settings
# (dracpu.config.settings); tests/test_settings_table.py fails while it is stale
[doc("rewrite docs/upstream-compatibility.md's table of every setting from dracpu.config")]
settings-doc:
    {{venv}}/python scripts/settings_doc.py

# run every benchmark; one JSON object per figure on stdout
bench:
    for f in bench/bench_*.py; do echo "# $f" >&2; {{venv}}/python "$f"; done

# this machine's topology and what it would publish
inspect *ARGS:
    {{venv}}/dracpu inspect {{ARGS}}

# build the DaemonSet image with podman (or docker): `just image`, `just image dracpu:v1`, extra
# build flags after the tag (e.g. --build-arg BASE_IMAGE=... or PIP_INDEX_URL / PIP_CERT)
[doc("build the DaemonSet image (podman or docker); build flags after the tag (docs/image.md)")]
image tag="dracpu:dev" *ARGS:
    #!/usr/bin/env bash
    set -euo pipefail
    engine=$(command -v podman || command -v docker || { echo "need podman or docker" >&2; exit 1; })
    "$engine" build -f Containerfile -t "{{tag}}" \
        --build-arg VERSION="$({{venv}}/python -c 'import dracpu; print(dracpu.__version__)')" \
        --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
        {{ARGS}} .

# end-to-end tests on kind (needs Docker, kind, kubectl: tests/e2e/README.md); args go to pytest
e2e *ARGS:
    tests/e2e/run.sh {{ARGS}}

# the local one-node cluster of real Kubernetes components (tests/cluster/README.md; root, Go):
# `just cluster up`, `just cluster deploy`, `just cluster down`, `just cluster env`
[doc("a local one-node cluster of real Kubernetes components: up, deploy, down, env")]
cluster *ARGS:
    tests/cluster/cluster {{ARGS}}

# what the local cluster needs from Debian (tests/cluster/README.md)
cluster-deps:
    apt-get install -y runc podman busybox-static containernetworking-plugins gcc libc6-dev debootstrap openssl curl \
        conmon libseccomp-dev pkg-config

# build (or reuse) the local cluster's binaries from tests/cluster/modules; prints their directory
cluster-build:
    tests/cluster/build

# the e2e suite on the local cluster: up, deploy, tests/e2e, artifacts on failure, down; args go
# to pytest. DRACPU_CLUSTER_RUNTIME picks the runtime (containerd, or crio)
[doc("the e2e suite on the local cluster (up, deploy, tests/e2e, down); args go to pytest")]
e2e-local *ARGS:
    tests/cluster/e2e {{ARGS}}

# the node simulator: the real daemon with a fake API server, kubelet and runtime
sim *ARGS:
    {{venv}}/dracpu sim {{ARGS}}
