#!/usr/bin/env bash
# Helm 3 post-renderer: hami-guard's patch on the output of HAMi's chart, or of a DRA driver's chart
# (render.py says what it does).
#   helm upgrade --install hami hami-charts/hami -n kube-system \
#     --post-renderer ./manifests/hami-patch/post-renderer.sh \
#     --post-renderer-args registry=<your registry>
# Helm 4 takes the same script as a plugin (plugin.yaml): --post-renderer hami-guard.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v python3 >/dev/null || { echo "hami-guard post-renderer: python3 is not on PATH" >&2; exit 1; }
exec python3 "$here/render.py" "$@"
