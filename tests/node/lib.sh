# Shell functions the node's scripts share (node.sh, inside.sh, second.sh source this file).

wait_for() { # seconds description command...: polls the command every 0.5 s until it succeeds
  local t=$1 what=$2 i
  shift 2
  for ((i = 0; i < t * 2; i++)); do
    "$@" > /dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "node-e2e: $what not up after ${t}s" >&2
  return 1
}

remove_cgroups() { # path: the cgroup path below every hierarchy's root, removed with its children
  local h
  for h in /sys/fs/cgroup/*/; do
    [ -d "$h$1" ] || continue
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      find "$h$1" -depth -type d -exec rmdir {} + 2> /dev/null || true
      [ -d "$h$1" ] || break
      sleep 0.5 # the last processes of a cgroup leave it a moment after they end
    done
    [ -d "$h$1" ] && echo "node-e2e: could not remove $h$1" >&2
  done
  return 0
}
