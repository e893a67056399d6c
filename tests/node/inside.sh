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

pids=()
stop_all() {
  # Reverse order; whatever is left ends with this namespace.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2> /dev/null || true; done
  [ -s "$run/kubelet.pid" ] && kill "$(cat "$run/kubelet.pid")" 2> /dev/null || true
  sleep 1
}
trap stop_all EXIT

wait_for() { # seconds description command...
  local t=$1 what=$2
  shift 2
  for ((i = 0; i < t * 2; i++)); do
    "$@" > /dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "node-e2e: $what not up after ${t}s"
  return 1
}

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
containerd --config "$run/containerd.toml" > "$log/containerd.log" 2>&1 &
pids+=($!)
wait_for 60 containerd ctr --address /run/containerd/containerd.sock version
for i in pause init sidecar; do
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
case "\$1" in
kubelet-stop)
  [ -s "$run/kubelet.pid" ] || exit 0
  pid=\$(cat "$run/kubelet.pid")
  kill "\$pid" 2> /dev/null || exit 0
  while kill -0 "\$pid" 2> /dev/null; do sleep 0.1; done
  : > "$run/kubelet.pid"
  ;;
kubelet-start)
  "$bin/kubelet-e2e" --config="$run/kubelet.yaml" --kubeconfig="$KUBECONFIG" --hostname-override=$NODE \
    --node-ip=$NODE_IP --v=2 >> "$log/kubelet.log" 2>&1 < /dev/null &
  echo \$! > "$run/kubelet.pid"
  ;;
kubelet-restart)
  "\$0" kubelet-stop && exec "\$0" kubelet-start
  ;;
*) echo "usage: node-ctl kubelet-start|kubelet-stop|kubelet-restart" >&2; exit 2 ;;
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
NODE_E2E_DIR=$run "$repo/.venv/bin/python" -m pytest -q -p no:cacheprovider -o addopts= -o timeout=1200 \
  -o python_files="e2e_*.py" ${NODE_E2E_TESTS:-tests/node}
rc=$?
set -e
if [ "${NODE_E2E_KEEP:-}" = 1 ]; then
  echo "node-e2e: kept up (tests exited $rc); touch $run/stop to tear it down"
  until [ -e "$run/stop" ]; do sleep 1; done
fi
exit $rc
