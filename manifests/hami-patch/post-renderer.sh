#!/usr/bin/env bash
# Helm post-renderer: applies hami-guard's patch to HAMi's chart output.
#   helm install hami hami-charts/hami --post-renderer ./manifests/hami-patch/post-renderer.sh
# Reads the rendered manifests on stdin, writes the patched ones on stdout.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cat > "$work/rendered.yaml"
mkdir "$work/hami-patch"
cp "$here/kustomization.yaml" "$here/patch.yaml" "$work/hami-patch/"
cat > "$work/kustomization.yaml" <<KUSTOMIZATION
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - rendered.yaml
components:
  - hami-patch
KUSTOMIZATION
exec kubectl kustomize "$work"
