#!/bin/sh
# Writes releases/go.1.MINOR.mod and .sum, the DRA fixture's modfile for k8s.io/kubernetes VERSION, as
# tests/realkubelet/releases/modfile.sh does for the device-manager fixture: every staging module the
# release's own go.mod replaces with ./staging is replaced by the published module of the same release
# (v1.34.4 -> v0.34.4), or by MODULE=VERSION where that one is not served; the fixture's direct
# dependencies are required at the release's own pins.
#
#   releases/modfile.sh v1.34.4
set -eu
cd "$(dirname "$0")/.."
version=$1
shift
minor=$(echo "$version" | cut -d. -f2)
mod=releases/go.1.$minor.mod
go mod download k8s.io/kubernetes@"$version"
upstream=$(go env GOMODCACHE)/k8s.io/kubernetes@$version/go.mod
pin() { sed -n "s|^[[:space:]]*$1 \(v[^ ]*\).*|\1|p" "$upstream" | head -n 1; }
staging=$(sed -n 's|^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/.*|\1|p' "$upstream")
{
	printf 'module hami-guard/tests/realdra\n\ngo 1.26.0\n\nrequire (\n\thami-guard/tests/fixturekit v0.0.0\n'
	for m in google.golang.org/grpc google.golang.org/protobuf k8s.io/klog/v2; do
		printf '\t%s %s\n' "$m" "$(pin "$m")"
	done
	for m in k8s.io/api k8s.io/apimachinery k8s.io/client-go k8s.io/dynamic-resource-allocation k8s.io/kubelet; do
		printf '\t%s v0.%s\n' "$m" "${version#v1.}"
	done
	printf '\tk8s.io/kubernetes %s\n)\n\n' "$version"
	printf '// k8s.io/kubernetes replaces its staging modules with ./staging paths, which a dependent\n'
	printf '// cannot use: pin every one of them at the release matching %s.\nreplace (\n' "$version"
	for m in $staging; do
		v=v0.${version#v1.}
		for o in "$@"; do [ "${o%%=*}" = "$m" ] && v=${o#*=}; done
		printf '\t%s => %s %s\n' "$m" "$m" "$v"
	done
	printf ')\n\n// The fixtures'"'"' shared protocol, subcommand dispatch and klog events (klog only).\n'
	printf 'replace hami-guard/tests/fixturekit => ../fixturekit\n'
} > "$mod"
rm -f "${mod%.mod}.sum"
go mod tidy -modfile="$mod"
