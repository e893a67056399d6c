#!/usr/bin/env bash
# The first process of the node's PID, mount and network namespaces (tests/node/node.sh starts it):
# brings the node up in $1, runs the tests, and returns their status. Its exit ends every process
# of the namespace; its mounts are the namespace's own.
set -euo pipefail
run=$1
cgroup=$2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin=$here/bin
log=$run/log
pki=$run/pki
mkdir -p "$log" "$pki" "$run/var-lib" "$run/var-log" "$run/run" "$run/cni" "$run/sysctl" "$run/etcd"
export KUBECONFIG=$run/admin.kubeconfig
NODE=node-e2e
NODE_IP=192.0.2.1 # TEST-NET-1 (RFC 5737), on an interface of this network namespace only
hostname "$NODE"

# Mounts: the kubelet's and containerd's fixed paths on folders of the run.
mount --make-rprivate /
mount --bind "$run/var-lib" /var/lib
mount --bind "$run/var-log" /var/log
mount --bind "$run/run" /run
mount --make-rshared /
# The kubelet sets vm.overcommit_memory, kernel.panic and kernel.panic_on_oops, which no namespace
# holds: it reads the values it wants from files bound over them here, and changes nothing.
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
  kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
  k=${kv%%=*}
  v=${kv#*=}
  [ "$(cat "/proc/sys/$k")" = "$v" ] && continue
  f=$run/sysctl/${k//\//.}
  echo "$v" > "$f"
  mount --bind "$f" "/proc/sys/$k"
  mount -o remount,bind,ro "/proc/sys/$k"
done

# Network: loopback, and a veth pair whose one end holds the node's address.
ip link set lo up
ip link add node0 type veth peer name node1
ip addr add "$NODE_IP/24" dev node0
ip link set node1 up
ip link set node0 up
ip route add default dev node0
# The pods reach the API server as in a cluster, at the `kubernetes` Service's address (10.96.0.1:443, the
# KUBERNETES_SERVICE_HOST of every pod; in the API server's certificate): kube-proxy's rule for that one
# Service, a DNAT to the API server here. HAMi's plugin (the stand-in) writes its node annotation and the
# sidecar reads it through it (tests/node/e2e_hami.py).
iptables -t nat -A PREROUTING -d 10.96.0.1/32 -p tcp --dport 443 -j DNAT --to-destination "$NODE_IP:6443"

pids=()
stop_all() {
  # Reverse order; whatever is left ends with this namespace.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2> /dev/null || true; done
  [ -s "$run/kubelet.pid" ] && kill "$(cat "$run/kubelet.pid")" 2> /dev/null || true
  sleep 1
}
trap stop_all EXIT

# wait_for, remove_cgroups
. "$here/lib.sh"

# PKI: a CA, the API server's serving certificate, one client certificate for every component.
cd "$pki"
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=node-e2e-ca 2> /dev/null
cert() { # name subject extensions
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2> /dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 2 \
    -extfile "$1.ext" 2> /dev/null
}
cert apiserver /CN=kube-apiserver "subjectAltName=IP:127.0.0.1,IP:$NODE_IP,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc
extendedKeyUsage=serverAuth"
cert admin "/O=system:masters/CN=node-e2e-admin" "extendedKeyUsage=clientAuth"
openssl genrsa -out sa.key 2048 2> /dev/null
openssl rsa -in sa.key -pubout -out sa.pub 2> /dev/null
kubectl config set-cluster e2e --server=https://127.0.0.1:6443 --certificate-authority=ca.crt --embed-certs > /dev/null
kubectl config set-credentials admin --client-certificate=admin.crt --client-key=admin.key --embed-certs > /dev/null
kubectl config set-context e2e --cluster=e2e --user=admin > /dev/null
kubectl config use-context e2e > /dev/null
cd "$run"

# etcd, the API server, the controller manager and the scheduler.
etcd --name "$NODE" --data-dir "$run/etcd" --listen-client-urls http://127.0.0.1:2379 \
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
  --initial-advertise-peer-urls http://127.0.0.1:2380 --initial-cluster "$NODE=http://127.0.0.1:2380" \
  > "$log/etcd.log" 2>&1 &
pids+=($!)
"$bin/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --secure-port=6443 \
  --advertise-address="$NODE_IP" --endpoint-reconciler-type=none --service-cluster-ip-range=10.96.0.0/16 \
  --client-ca-file="$pki/ca.crt" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
  --kubelet-client-certificate="$pki/admin.crt" --kubelet-client-key="$pki/admin.key" \
  --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$pki/sa.pub" \
  --service-account-signing-key-file="$pki/sa.key" --authorization-mode=RBAC --allow-privileged=true \
  > "$log/kube-apiserver.log" 2>&1 &
pids+=($!)
wait_for 120 kube-apiserver kubectl get --raw /readyz
"$bin/kube-controller-manager" --kubeconfig="$KUBECONFIG" --leader-elect=false --bind-address=127.0.0.1 \
  --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
  --use-service-account-credentials=false > "$log/kube-controller-manager.log" 2>&1 &
pids+=($!)
"$bin/kube-scheduler" --kubeconfig="$KUBECONFIG" --leader-elect=false --bind-address=127.0.0.1 \
  > "$log/kube-scheduler.log" 2>&1 &
pids+=($!)

# containerd (Debian's, with runc) and its CNI: a bridge with host-local addresses.
pause_image=${NODE_E2E_PAUSE_IMAGE:-localhost/node-e2e/pause:1}
cat > "$run/containerd.toml" << TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  # Root here may lack CAP_SYS_RESOURCE: runc then cannot lower oom_score_adj and no sandbox starts.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$run/cni"
TOML
cat > "$run/cni/10-node-e2e.conflist" << 'JSON'
{"cniVersion": "0.4.0", "name": "node-e2e", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]], "routes": [{"dst": "0.0.0.0/0"}]}}
]}
JSON
# The node's own processes (containerd, its pods, the kubelet) in a PID and mount namespace nested in
# this one (second.sh holder): a hostPID pod sees this node's processes only, not a second node's
# (tests/node/second.sh) nor the control plane's; this namespace sees them all.
unshare --pid --mount --fork --mount-proc --propagation slave --kill-child \
  "$here/second.sh" holder "$run" "$cgroup" > "$log/holder.log" 2>&1 < /dev/null &
pids+=($!)
wait_for 10 "the node's PID namespace" test -e "$run/holder.ready"
awk '{print $1}' "/proc/$!/task/$!/children" > "$run/holder.pid"
in_node() { nsenter -t "$(cat "$run/holder.pid")" -p -m -- "$@"; }
in_node containerd --config "$run/containerd.toml" > "$log/containerd.log" 2>&1 &
pids+=($!)
wait_for 60 containerd ctr --address /run/containerd/containerd.sock version
for i in pause init sidecar standin; do
  ctr --address /run/containerd/containerd.sock -n k8s.io images import "$repo/build/node-e2e/images/$i.tar" > /dev/null
done

# The kubelet: cgroup v1 and cgroupfs as this machine has them, eviction thresholds relaxed.
cat > "$run/kubelet.yaml" << YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: /$cgroup
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: 0.0.0.0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: AlwaysAllow}
evictionHard: {memory.available: 50Mi, nodefs.available: 1%, nodefs.inodesFree: 1%, imagefs.available: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: /etc/resolv.conf
serializeImagePulls: false
YAML
cat > "$run/node-ctl" << SH
#!/bin/sh
# node-ctl kubelet-start | kubelet-stop | kubelet-restart: the kubelet as a process of this namespace.
# node-ctl node2-start | node2-stop: the second node, node-e2e-2, joined and Ready, or gone (second.sh).
# The kubelet is found by what it runs (kubelet-e2e with this node's config), never by a remembered pid:
# a stop that missed it would start a second kubelet beside the first.
kubelet_pids() {
  for p in /proc/[0-9]*; do
    [ "\$(cat "\$p/comm" 2> /dev/null)" = kubelet-e2e ] || continue
    tr '\\0' ' ' < "\$p/cmdline" 2> /dev/null | grep -q -- "--config=$run/kubelet.yaml " && echo "\${p#/proc/}"
  done
}
case "\$1" in
kubelet-stop)
  pids=\$(kubelet_pids)
  [ -n "\$pids" ] || exit 0
  kill \$pids 2> /dev/null
  for _ in \$(seq 600); do
    [ -z "\$(kubelet_pids)" ] && { : > "$run/kubelet.pid"; exit 0; }
    sleep 0.1
  done
  echo "node-ctl: the kubelet (\$pids) did not stop in 60 s" >&2
  exit 1
  ;;
kubelet-start)
  [ -z "\$(kubelet_pids)" ] || { echo "node-ctl: a kubelet runs already: \$(kubelet_pids)" >&2; exit 1; }
  # In the node's namespaces (nsenter's child).
  nsenter -t "\$(cat "$run/holder.pid")" -p -m -- "$bin/kubelet-e2e" --config="$run/kubelet.yaml" \
    --kubeconfig="$KUBECONFIG" --hostname-override=$NODE --node-ip=$NODE_IP --v=2 >> "$log/kubelet.log" 2>&1 < /dev/null &
  for _ in \$(seq 100); do
    pid=\$(kubelet_pids)
    [ -n "\$pid" ] && { echo "\$pid" > "$run/kubelet.pid"; exit 0; }
    sleep 0.05
  done
  echo "node-ctl: the kubelet did not start" >&2
  exit 1
  ;;
kubelet-restart)
  "\$0" kubelet-stop && exec "\$0" kubelet-start
  ;;
node2-start | node2-stop)
  exec "$here/second.sh" "\${1#node2-}" "$run" "$cgroup"
  ;;
*) echo "usage: node-ctl kubelet-start|kubelet-stop|kubelet-restart|node2-start|node2-stop" >&2; exit 2 ;;
esac
SH
chmod +x "$run/node-ctl"
"$run/node-ctl" kubelet-start
wait_for 180 "node Ready" sh -c "kubectl get node $NODE -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
kubectl label node "$NODE" gpu=on > /dev/null
kubectl -n kube-system create serviceaccount hami-device-plugin > /dev/null
echo "node-e2e: node $NODE Ready ($(date -u +%T))"

set +e
cd "$repo"
# e2e_node.py first: its healthy node is the DaemonSet as deployed, its plugin never restarted yet.
NODE_E2E_DIR=$run "$repo/.venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= -o timeout=1200 \
  -o python_files="e2e_*.py" ${NODE_E2E_TESTS:-tests/node/e2e_node.py tests/node/e2e_hami.py tests/node/e2e_vendors.py tests/node/e2e_fleet.py tests/node/e2e_rollout.py}
rc=$?
set -e
if [ "${NODE_E2E_KEEP:-}" = 1 ]; then
  echo "node-e2e: kept up (tests exited $rc); touch $run/stop to tear it down"
  until [ -e "$run/stop" ]; do sleep 1; done
fi
exit $rc
