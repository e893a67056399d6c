#!/usr/bin/env bash
# The second node, node-e2e-2: `node-ctl node2-start` and `node-ctl node2-stop` (tests/node/inside.sh)
# run this inside the namespaces node.sh makes, for the tests that need two nodes (a DaemonSet rollout).
#
#   second.sh start RUN CGROUP   up, joined and Ready (labelled gpu=on like the first node)
#   second.sh stop RUN CGROUP    the Node and its pods deleted, every process of it ended, its cgroups removed
#   second.sh inner RUN CGROUP   (the node's first process, in its own namespaces)
#   second.sh holder RUN CGROUP  (the first node's PID namespace's first process: inside.sh)
#
# Its own PID namespace nested in node.sh's (its processes end with it, and with the whole run), beside
# the first node's (`holder`: a hostPID pod of either node sees its own node's processes only), its
# own mount namespace (its own /var/lib, /var/log and /run on folders of RUN/node-e2e-2: its own
# device-plugins folder, containerd and /run/hami-standin), its own network and UTS namespaces (a veth
# pair into the first node's namespace, 192.0.2.2; it reaches the API server at 192.0.2.1:6443; its pods
# on 10.89.0.0/16, routed from the first node), its own containerd and kubelet-e2e (cgroup root
# /CGROUP/node-e2e-2, under the first node's, which node.sh removes in any case).
set -euo pipefail
cmd=$1
run=$2
cgroup=$3
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
NODE=node-e2e-2
NODE_IP=192.0.2.2
API_IP=192.0.2.1
POD_NET=10.89.0.0/16
dir=$run/$NODE
log=$dir/log
croot=$cgroup/$NODE
export KUBECONFIG=$run/admin.kubeconfig

# wait_for, remove_cgroups
. "$here/lib.sh"

# A new /proc (a PID namespace of its own): the kernel settings the kubelet reads are bound over it
# again (the files inside.sh made), so that it changes none on the machine.
sysctl_binds() {
  local f k
  for f in "$run"/sysctl/*; do
    [ -e "$f" ] || continue
    k=$(basename "$f")
    mount --bind "$f" "/proc/sys/${k//.//}"
    mount -o remount,bind,ro "/proc/sys/${k//.//}"
  done
}

case $cmd in
start)
  [ -s "$dir/unshare.pid" ] && kill -0 "$(cat "$dir/unshare.pid")" 2> /dev/null && {
    echo "node-e2e: $NODE already up" >&2
    exit 1
  }
  rm -rf "$dir"
  mkdir -p "$log" "$dir/var-lib" "$dir/var-log" "$dir/run" "$dir/cni"
  for h in /sys/fs/cgroup/*/; do
    [ -d "$h$cgroup" ] || continue
    mkdir -p "$h$croot"
    if [ -f "$h${cgroup}/cpuset.cpus" ]; then
      cat "$h$cgroup/cpuset.cpus" > "$h$croot/cpuset.cpus"
      cat "$h$cgroup/cpuset.mems" > "$h$croot/cpuset.mems"
    fi
  done
  # The node's configuration: the first node's, with its own folders, cgroup root and pod network.
  sed "s|^cgroupRoot: .*|cgroupRoot: /$croot|" "$run/kubelet.yaml" > "$dir/kubelet.yaml"
  sed "s|conf_dir = .*|conf_dir = \"$dir/cni\"|" "$run/containerd.toml" > "$dir/containerd.toml"
  sed "s|10.88.0.0/16|$POD_NET|; s|\"node-e2e\"|\"$NODE\"|" "$run/cni/10-node-e2e.conflist" > "$dir/cni/10-node-e2e.conflist"
  kc=$dir/kubeconfig
  kubectl config view --raw --minify --flatten > "$kc"
  kubectl --kubeconfig "$kc" config set-cluster e2e --server="https://$API_IP:6443" > /dev/null

  unshare --pid --mount --net --uts --fork --mount-proc --kill-child --propagation private \
    "$here/second.sh" inner "$run" "$cgroup" >> "$log/node.log" 2>&1 < /dev/null &
  echo $! > "$dir/unshare.pid"
  # unshare has its new network namespace once it differs from this one's: the veth's far end goes in.
  self=$(readlink /proc/self/ns/net)
  wait_for 10 "$NODE's network namespace" sh -c "[ \"\$(readlink /proc/$!/ns/net)\" != '$self' ]"
  ip link add n2 type veth peer name n2-eth
  ip link set n2-eth netns "$!"
  ip link set n2 up
  ip route add "$NODE_IP/32" dev n2
  ip route add "$POD_NET" via "$NODE_IP" dev n2 onlink
  wait_for 240 "$NODE Ready" sh -c "kubectl get node $NODE -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True" || {
    tail -20 "$log/node.log" "$log/kubelet.log" >&2
    exit 1
  }
  kubectl label node "$NODE" gpu=on > /dev/null
  echo "node-e2e: node $NODE Ready ($(date -u +%T))"
  ;;

stop)
  # The node's processes first (the kubelet would report the Node's pods again), then its objects.
  if [ -s "$dir/unshare.pid" ]; then
    pid=$(cat "$dir/unshare.pid")
    # unshare's child is the node's first process: its exit ends every process of the node's namespace.
    first=$(cat "/proc/$pid/task/$pid/children" 2> /dev/null | awk '{print $1}')
    kill "$pid" 2> /dev/null || true
    alive() { [ -n "$1" ] && [ -e "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status" 2> /dev/null; }
    for _ in $(seq 100); do
      alive "$pid" || alive "$first" || break
      sleep 0.1
    done
    : > "$dir/unshare.pid"
  fi
  kubectl delete node "$NODE" --ignore-not-found --wait=true > /dev/null || true
  kubectl delete pods -A --field-selector "spec.nodeName=$NODE" --force --grace-period=0 > /dev/null 2>&1 || true
  ip link del n2 2> /dev/null || true # gone with the namespace already, with its routes
  remove_cgroups "$croot"
  echo "node-e2e: node $NODE stopped ($(date -u +%T))"
  ;;

holder)
  # PID 1 of the first node's PID namespace: its processes are started into it with nsenter; it reaps
  # the orphans among them, and its end ends them all.
  sysctl_binds
  touch "$run/holder.ready"
  trap 'exit 0' TERM
  while :; do
    sleep 3600 &
    wait || true
  done
  ;;

inner)
  hostname "$NODE"
  mount --bind "$dir/var-lib" /var/lib
  mount --bind "$dir/var-log" /var/log
  mount --bind "$dir/run" /run
  mount --make-rshared /
  sysctl_binds
  ip link set lo up
  wait_for 10 "the veth's end" ip link show n2-eth
  ip addr add "$NODE_IP/24" dev n2-eth
  ip link set n2-eth up
  ip route add default via "$API_IP" dev n2-eth
  containerd --config "$dir/containerd.toml" > "$log/containerd.log" 2>&1 &
  wait_for 60 "$NODE's containerd" ctr --address /run/containerd/containerd.sock version
  for i in pause init sidecar standin; do
    ctr --address /run/containerd/containerd.sock -n k8s.io images import "$repo/build/node-e2e/images/$i.tar" > /dev/null
  done
  "$here/bin/kubelet-e2e" --config="$dir/kubelet.yaml" --kubeconfig="$dir/kubeconfig" \
    --hostname-override=$NODE --node-ip=$NODE_IP --v=1 > "$log/kubelet.log" 2>&1 < /dev/null &
  wait
  ;;

*)
  echo "usage: second.sh start|stop|inner RUN CGROUP" >&2
  exit 2
  ;;
esac
