#!/usr/bin/env bash
# End-to-end tests on a real kind cluster. They need Docker (or podman) and kind on PATH, which the
# development machine of this project does not have; this script says so and exits 1 there.
set -euo pipefail
for tool in docker kind kubectl; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "just e2e needs $tool on PATH (Docker, kind and kubectl); it is not here." >&2
    echo "The e2e suite builds the image (Containerfile), creates a kind cluster with NRI enabled," >&2
    echo "deploys deploy/kustomize/overlays/kind and asserts Cpus_allowed_list inside pods." >&2
    exit 1
  fi
done
echo "e2e suite: not written yet (tracked in the issues); nothing was run." >&2
exit 1
