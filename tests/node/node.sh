#!/usr/bin/env bash
# make node-e2e: a single-node cluster in a temporary folder, from real components (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, the kubelet, containerd and runc, CNI bridge), running the
# end-to-end tests of tests/node/e2e_node.py against the project's images, then torn down.
#
# Everything runs inside new PID, mount and network namespaces (unshare): on loopback and a dummy
# interface of that network namespace only, the kubelet's fixed /var/lib/kubelet paths bound over a
# folder of the run, and when the namespace's first process exits the kernel ends every process in it.
# What the host keeps afterwards: nothing but the node's cgroups, removed here. The kubelet binary is
# named kubelet-e2e, so no process named `kubelet` is ever visible in the host's /proc (the project's
# tests look for one).
#
# NODE_E2E_KEEP=1: keep the cluster up after the tests (the script says how to reach it).
# NODE_E2E_TESTS: pytest arguments (default: tests/node's e2e_node.py, e2e_hami.py, e2e_vendors.py,
# e2e_fleet.py, e2e_rollout.py).
# NODE_E2E_RUNS: runs of tests/node/e2e_hami.py's measured scenario (default 1).
# Under CI=true a missing component is an error; otherwise the run is skipped with the reason.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
. "$here/lib.sh" # wait_for, remove_cgroups

missing=()
[ "$(id -u)" = 0 ] || missing+=("root (namespaces, mounts, cgroups)")
for tool in unshare nsenter ip iptables openssl etcd containerd containerd-shim-runc-v2 runc ctr kubectl; do
  command -v "$tool" > /dev/null || missing+=("$tool")
done
[ -x /usr/lib/cni/bridge ] || missing+=("/usr/lib/cni/bridge (containernetworking-plugins)")
for b in kubelet-e2e kube-apiserver kube-controller-manager kube-scheduler; do
  [ -x "$here/bin/$b" ] || missing+=("tests/node/bin/$b (make node-bins)")
done
for i in init sidecar standin pause; do
  [ -s "$repo/build/node-e2e/images/$i.tar" ] || missing+=("build/node-e2e/images/$i.tar (make node-images)")
done
if ((${#missing[@]})); then
  printf 'node-e2e: missing: %s\n' "${missing[@]}"
  [ "${CI:-}" = true ] && exit 1
  echo "node-e2e: skipped (CI=true makes this an error)"
  exit 0
fi

run=$(mktemp -d /tmp/node-e2e.XXXXXX)
chmod 755 "$run"
cgroup=node-e2e-${run##*.}
echo "node-e2e: $run (cgroup root /$cgroup)"

cleanup() {
  if [ -s "$run/figures.txt" ]; then
    echo "node-e2e: figures"
    sed 's/^/  /' "$run/figures.txt"
  fi
  # The namespace's processes are gone with unshare; only the cgroups remain on the host's cgroupfs.
  remove_cgroups "$cgroup"
  if [ "${rc:-1}" != 0 ] && [ -d "$run/log" ]; then
    # A failed run keeps its logs (the components', the pods' of both nodes) for a look, and prints the
    # end of the plugin pods' containers' logs: what the sidecar judged and what the stand-in did.
    keep=$repo/build/node-e2e/failed
    rm -rf "$keep"
    mkdir -p "$keep"
    (cd "$run" && tar -cf - log var-log/pods node-e2e-*/log node-e2e-*/var-log/pods 2> /dev/null) |
      tar -C "$keep" -xf - || true
    echo "node-e2e: the run failed; its logs are in $keep"
    for f in "$keep"/var-log/pods/*/{device-plugin,hami-sidecar}/*.log \
      "$keep"/node-e2e-*/var-log/pods/*/{device-plugin,hami-sidecar}/*.log; do
      [ -f "$f" ] || continue
      echo "== ${f#"$keep"/} (last 40 lines)"
      tail -n 40 "$f" || true
    done
  fi
  if [ "${NODE_E2E_KEEP_FILES:-}" = 1 ]; then
    echo "node-e2e: files kept in $run"
  else
    rm -rf "$run"
  fi
}
trap cleanup EXIT

# The cgroup root the kubelet runs its pods under (it must exist), in every v1 hierarchy.
for h in /sys/fs/cgroup/*/; do
  case $h in */unified/) continue ;; esac
  mkdir "$h$cgroup" 2> /dev/null || continue
  if [ -f "${h}cpuset.cpus" ]; then
    cat "${h}cpuset.cpus" > "$h$cgroup/cpuset.cpus"
    cat "${h}cpuset.mems" > "$h$cgroup/cpuset.mems"
  fi
done

unshare --pid --mount --net --uts --fork --mount-proc --kill-child --propagation private \
  "$here/inside.sh" "$run" "$cgroup" &
ns=$!
if [ "${NODE_E2E_KEEP:-}" = 1 ]; then
  sleep 1
  first=$(cat "/proc/$ns/task/$ns/children" 2> /dev/null | awk '{print $1}')
  echo "node-e2e: NODE_E2E_KEEP=1: once the tests end, enter the node with"
  echo "  nsenter -t $first -m -n -p -u env KUBECONFIG=$run/admin.kubeconfig kubectl get pods -A"
fi
set +e
wait "$ns"
rc=$?
set -e
echo "node-e2e: exit $rc"
exit $rc
