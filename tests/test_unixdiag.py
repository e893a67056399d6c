"""The kernel's tables of Unix sockets as `hami_guard.node.unixdiag` reads them: total decoders, and lines or
messages that a hostile neighbour makes up never counted as the kubelet's connections.

Real sockets in network namespaces of the test's own (`testing.netns`, root as in CI); the
decoders also get every prefix and damaged copies of replies and tables the kernel wrote here."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from hami_guard.node.kubelet import listeners, listening_paths
from hami_guard.node.netunix import (
    ESTABLISHED,
    LISTEN,
    NAME_MAX,
    PROC_HEADER,
    listed_inodes,
    parse_proc_net_unix,
    read_proc_net_unix,
)
from hami_guard.node.unixdiag import (
    NLMSG_DONE,
    NLMSG_ERROR,
    SOCK_DIAG_BY_FAMILY,
    Connections,
    decode_reply,
    kubelet_connections,
)
from testing import netns
from testing.netns import Netns
from tests.forged import (
    NOBODY,
    ROOT_NO_CAPS,
    Holder,
    comm,
    connect,
    forged_names,
    in_a_mount_namespace,
    kernel_line,
    listen,
    names,
    nsenter,
    pair,
    serve,
    unprivileged,
)

# Runs in a namespace: binds the names it is given (hex), with a connection to each, then prints the raw
# datagrams of one sock_diag dump and the namespace's /proc/self/net/unix, as hex, in JSON.
CAPTURE = r"""
import json, socket, sys
from hami_guard.node.unixdiag import diag_request
held = []
for name in map(bytes.fromhex, sys.argv[1:]):
    s = socket.socket(socket.AF_UNIX); s.bind(name); s.listen()
    c = socket.socket(socket.AF_UNIX); c.connect(name)
    held += [s, c, s.accept()[0]]
a = socket.socket(socket.AF_UNIX); a.bind(b"\0hami-guard-test"); a.listen(); held.append(a)
n = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)
n.settimeout(2); n.send(diag_request())
grams = []
while True:
    data = n.recv(1 << 16); grams.append(data.hex())
    if int.from_bytes(data[4:6], "little") in (2, 3):
        break
table = open("/proc/self/net/unix", "rb").read().hex()
print(json.dumps({"grams": grams, "table": table}))
"""


def capture(ns: Netns, *paths: str) -> tuple[list[bytes], bytes]:
    argv = [sys.executable, "-c", CAPTURE, *(p.encode().hex() for p in paths)]
    done = ns.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return [bytes.fromhex(g) for g in out["grams"]], bytes.fromhex(out["table"])


@pytest.fixture
def ns() -> Iterator[Netns]:
    netns.require()
    with Netns() as n:
        yield n


def message(kind: int, payload: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), kind, 0, 1, 0) + payload + b"\0" * (-len(payload) % 4)


# -- sock_diag -----------------------------------------------------------------------------------------
def test_the_replies_the_fuzzer_found_are_typed_results() -> None:
    """Each of these raised (struct.error, OverflowError) before the decoder was made total."""
    short = decode_reply(message(SOCK_DIAG_BY_FAMILY, b"\x01" * 15))
    assert (short.sockets, short.skipped, short.error, short.done) == ((), 1, "", False)
    assert decode_reply(message(NLMSG_ERROR, b"")).error == "an error message of 0 bytes"
    assert decode_reply(message(NLMSG_ERROR, struct.pack("=i", -(2**31)))).error == "error 2147483648"
    assert decode_reply(message(NLMSG_ERROR, struct.pack("=i", -13))).error == os.strerror(13)
    assert decode_reply(message(NLMSG_ERROR, struct.pack("=i", 0))).error == os.strerror(5)
    assert decode_reply(message(NLMSG_DONE, b"")).done
    # A length past the datagram, below a header, and an attribute running past its message.
    assert decode_reply(struct.pack("=IHHII", 100, NLMSG_DONE, 0, 0, 0) + b"\xff" * 40).error
    assert decode_reply(struct.pack("=IHHII", 3, NLMSG_DONE, 0, 0, 0)).error
    msg = struct.pack("=BBBBI2I", socket.AF_UNIX, 1, LISTEN, 0, 77, 0, 0) + struct.pack("=HH", 200, 0)
    assert decode_reply(message(SOCK_DIAG_BY_FAMILY, msg)).skipped == 1
    other = struct.pack("=BBBBI2I", socket.AF_INET, 1, LISTEN, 0, 77, 0, 0)
    assert decode_reply(message(SOCK_DIAG_BY_FAMILY, other)).skipped == 1
    assert decode_reply(b"\0" * 7).skipped == 1


def test_a_kernel_reply_decodes_and_every_damaged_copy_is_a_typed_result(ns: Netns, short_tmp: str) -> None:
    path = os.path.join(short_tmp, "nvidia-gpu.sock")
    grams, _ = capture(ns, path)
    replies = [decode_reply(g) for g in grams]
    assert replies[-1].done and not any(r.error or r.skipped for r in replies)
    sockets = [s for r in replies for s in r.sockets]
    st = os.stat(path)
    accepted = [s for s in sockets if s.vfs == (st.st_dev, st.st_ino) and s.state == ESTABLISHED]
    assert len(accepted) == 1 and accepted[0].path == path
    client = next(s for s in sockets if s.ino == accepted[0].peer)
    assert client.peer == accepted[0].ino and client.vfs is None
    assert any(s.path == "" and s.state == LISTEN and s.vfs is None for s in sockets)  # the abstract one
    data = grams[0]
    for cut in range(len(data) + 1):
        decode_reply(data[:cut])
    for at in range(len(data)):
        for byte in (0x00, 0x03, 0x7F, 0xFF):
            decode_reply(data[:at] + bytes([byte]) + data[at + 1 :])


# -- /proc/<pid>/net/unix ------------------------------------------------------------------------------
def test_a_kernel_table_parses_and_every_damaged_copy_is_a_typed_result(ns: Netns, short_tmp: str) -> None:
    path = os.path.join(short_tmp, "nvidia-gpu.sock")
    _, table = capture(ns, path)
    parsed = parse_proc_net_unix(table.splitlines(keepends=True))
    assert parsed.skipped == 0
    # A short line after a name may be a part of it (here an unnamed socket's, after the abstract name);
    # a line with a path this long never is.
    assert all(s.path == "" for s in parsed.doubtful)
    assert sorted(s.state for s in parsed.sockets if s.path == path) == [ESTABLISHED, LISTEN]
    for cut in range(0, len(table) + 1, 7):
        parse_proc_net_unix(table[:cut].splitlines(keepends=True))
    for at in range(len(table)):
        damaged = table[:at] + b"\n" + table[at + 1 :]
        parse_proc_net_unix(damaged.splitlines(keepends=True))


def test_lines_inside_a_name_are_never_sockets(ns: Netns, short_tmp: str) -> None:
    """The names of the report, and the same lies in the kernel's own format, bound for real: none of
    their lines is a socket; a real connection's line, whatever precedes it, is one."""
    dp = os.path.join(short_tmp, "device-plugins")
    os.mkdir(dp)
    kubelet, plugin = os.path.join(dp, "kubelet.sock"), os.path.join(dp, "nvidia-gpu.sock")
    lies = forged_names(kubelet, plugin, "/var/lib/kubelet/device-plugins")
    assert len(lies) == 9
    with Holder([*names(*lies), *names(plugin.encode())], ns.command([])) as h:
        with open(f"/proc/{h.pid}/net/unix", "rb") as f:
            raw = f.read()
        # The lie is printed, as a part of the name of the listener and of its accepted end.
        assert raw.count(b" 03 12347 " + plugin.encode()) == 2
        table = read_proc_net_unix(f"/proc/{h.pid}")
    paths = {kubelet, plugin, "/var/lib/kubelet/device-plugins/kubelet.sock"}
    paths.add("/var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    real = [s for s in table.sockets if s.path in paths]
    assert sorted((s.state, s.path) for s in real) == [(ESTABLISHED, plugin), (LISTEN, plugin)]
    assert all(s.ino > 20000 for s in real)
    made_up = {s.ino for s in table.doubtful if s.path in paths}
    assert made_up == {12345, 12346, 12347, 12348}, table.doubtful
    assert table.skipped == 2 * 5  # "x x x 0 x 03 ..." (4 names) and "A", each on two sockets


def test_the_bounds_of_a_name() -> None:
    """A line is doubtful exactly when it fits in the longest name printed before it."""
    header = b"Num       RefCount Protocol Flags    Type St Inode Path\n"
    host = kernel_line("03", "00000000", 999999, "@") + b"\n"  # the name "@\n<lie>" starts at "@"
    bare = len(kernel_line("03", "00000000", 12345, ""))
    for length in (NAME_MAX - 1, NAME_MAX, NAME_MAX + 1):  # of "@" + "\n" + the lie
        lie = kernel_line("03", "00000000", 12345, "/" + "p" * (length - 2 - bare - 1))
        assert len(lie) + 2 == length
        table = parse_proc_net_unix((header + host + lie + b"\n").splitlines(keepends=True))
        doubtful = length <= NAME_MAX
        assert ([s.ino for s in table.doubtful], [s.ino for s in table.sockets]) == (
            ([12345], [999999]) if doubtful else ([], [999999, 12345])
        )
    assert parse_proc_net_unix([]).sockets == ()
    assert parse_proc_net_unix([b"garbage"]).skipped == 1
    narrow = b"0000000000000000: 00000002 00000000 00000000 0001 03 1234 /x\n"  # "%5lu" is five wide
    assert parse_proc_net_unix([header, narrow]).skipped == 1


# -- whose connections ---------------------------------------------------------------------------------
def test_a_process_named_kubelet_counts_only_run_by_root(ns: Netns, short_tmp: str) -> None:
    """A listener on the kubelet's path and a connection to the plugin's, real sockets in a namespace
    of their own, held by a process named as the kubelet: by nobody, it is not the kubelet; by root it is
    (root may do anything on the node)."""
    folder = os.path.join(short_tmp, "fake")
    os.mkdir(folder)
    os.chmod(short_tmp, 0o755)
    os.chmod(folder, 0o777)
    kubelet, plugin = os.path.join(folder, "kubelet.sock"), os.path.join(folder, "nvidia-gpu.sock")
    name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
    ops = [comm(name), listen(kubelet), *names(plugin.encode())]
    for enter, seen in ((NOBODY, False), ([], True)):
        with Holder(ops, ns.command(enter)) as h:
            found = kubelet_connections(kubelet, names={name}, mine="no sock_diag here")
            # Not seen, it is not read (pid 1's namespace may be, where no kubelet process is named).
            ours = f"the kubelet's network namespace (/proc/{h.pid}/net/unix)"
            assert (isinstance(found, Connections) and found.source == ours) is seen, found
            if seen:
                assert isinstance(found, Connections)
                why = "a listener is bound at nvidia-gpu.sock's path in the kubelet's network namespace, not "
                assert (
                    found.held(plugin)
                    == why + "this pod's: whose connections are whose cannot be told by path"
                )
        for p in (kubelet, plugin):
            os.unlink(p)


ROOT = Path(__file__).resolve().parent.parent

READ = (
    "import json, sys; from hami_guard.node.unixdiag import kubelet_connections as k; "
    "c = k(sys.argv[1], names={sys.argv[2]}, served=sys.argv[3:]); "
    "print(json.dumps(c if isinstance(c, str) else [c.source, c.held(sys.argv[3]), c.owned is not None]))"
)

# The connections a look between rounds watches: every one the table shows at the plugin's path, and
# the kubelet's own where they can be told.
LISTED = READ.replace(
    "[c.source, c.held(sys.argv[3]), c.owned is not None]",
    "[sorted(c.listed(sys.argv[3])), a if isinstance(a := c.accepted(sys.argv[3]), str) else sorted(a)]",
)


def reader(folder: str) -> tuple[list[str], dict[str, str]]:
    """READ's argv head and environment for any user: the interpreter by its real path and a copy of
    hami_guard (the standard library only) in `folder`, which must be readable by all. Nobody may not
    enter the checkout (a clone in a mode-700 folder) nor the virtual environment inside it."""
    lib = os.path.join(folder, "lib")
    shutil.copytree(
        ROOT / "hami_guard", os.path.join(lib, "hami_guard"), ignore=shutil.ignore_patterns("__pycache__")
    )
    for path, _, files in os.walk(lib):
        os.chmod(path, 0o755)
        for f in files:
            os.chmod(os.path.join(path, f), 0o644)
    return [os.path.realpath(sys.executable), "-c", READ], {
        **os.environ,
        "PYTHONPATH": lib,
        "PYTHONNOUSERSITE": "1",
    }


def test_sock_diag_counts_the_kubelets_own_connections_where_its_descriptors_can_be_read(
    ns: Netns, short_tmp: str
) -> None:
    """In the kubelet's namespace: the kubelet's connection to the plugin, and another process's. With
    the kubelet's descriptors readable (root with its capabilities) only the kubelet's counts; as
    nobody with no capability (the sidecar in HAMi's pod) both do, by the plugin file's inode."""
    folder = os.path.join(short_tmp, "dp")
    os.mkdir(folder)
    kubelet, plugin = os.path.join(folder, "kubelet.sock"), os.path.join(folder, "nvidia-gpu.sock")
    name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(plugin)
        server.listen()
        os.chmod(short_tmp, 0o755)
        with (
            Holder([comm(name), listen(kubelet), connect(plugin)], ns.command([])),
            Holder([connect(plugin)], ns.command([])),
        ):
            accepted = [server.accept()[0] for _ in range(2)]  # as the plugin's gRPC server does
            head, env = reader(short_tmp)
            argv = [*head, kubelet, name, plugin]
            for enter, count, owned in (([], 1, True), (ROOT_NO_CAPS, 2, False), (NOBODY, 2, False)):
                done = ns.run([*enter, *argv], capture_output=True, text=True, timeout=60, env=env)
                assert done.returncode == 0, done.stderr
                assert json.loads(done.stdout) == ["this network namespace (sock_diag)", count, owned]
            for a in accepted:
                a.close()


def test_nobody_cannot_read_a_root_process_descriptors() -> None:
    """What the sidecar in HAMi's pod (no capability) can read: net/unix of a root process, not its fd."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become nobody")
    probe = "import os, sys; os.listdir(f'/proc/{sys.argv[1]}/fd')"
    denied = subprocess.run([*NOBODY, sys.executable, "-c", probe, "1"], capture_output=True, text=True)
    assert "PermissionError" in denied.stderr
    table = "import sys; open(f'/proc/{sys.argv[1]}/net/unix', 'rb').read()"
    assert subprocess.run([*NOBODY, sys.executable, "-c", table, "1"], capture_output=True).returncode == 0


def test_from_a_pod_the_kubelets_namespace_through_proc_whoever_reads_it(short_tmp: str) -> None:
    """HAMi's layout: the plugin's listener in the pod's namespace, the kubelet (a root process named as
    one) and a hostile neighbour's names in the kubelet's. Read from the pod through /proc as root, as root
    with no capability (the manifests' sidecar: the kubelet's descriptors are listed, their links not
    readable) and as nobody. As root the kubelet's connection counts once (among the descriptors of the
    plugin's process), the names' lines never; without CAP_SYS_PTRACE the plugin's descriptors cannot be
    read, and a connection seen by path is no count; nobody cannot connect to kubelet.sock (mode 755),
    so which process listens on it, the kubelet, cannot be told."""
    netns.require()
    os.chmod(short_tmp, 0o755)
    folder = os.path.join(short_tmp, "device-plugins")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    kubelet, plugin = os.path.join(folder, "kubelet.sock"), os.path.join(folder, "nvidia-gpu.sock")
    name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
    lies = forged_names(kubelet, plugin, "/var/lib/kubelet/device-plugins")
    head, env = reader(short_tmp)
    argv = [*head, kubelet, name, plugin]
    kubelet_ops = [comm(name), listen(kubelet), connect(plugin), *names(*lies)]
    with (
        Netns() as pod,
        Netns() as node,
        Holder([serve(plugin)], pod.command([])),
        Holder(kubelet_ops, node.command([])) as k,  # it connects once the plugin serves
    ):
        ours = f"the kubelet's network namespace (/proc/{k.pid}/net/unix)"
        done = pod.run(argv, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[:2] == [ours, 1]
        done = pod.run([*ROOT_NO_CAPS, *argv], capture_output=True, text=True, timeout=60, env=env)
        source, held, _ = json.loads(done.stdout)
        assert source == ours
        assert held.startswith("the kubelet's net/unix shows 1 connection(s) to nvidia-gpu.sock by path only")
        assert held.endswith("cannot be read (that needs CAP_SYS_PTRACE)"), held
        # What the look between rounds watches without the capability: the kubelet's connection too.
        listed = [head[0], "-c", LISTED, *argv[3:]]
        done = pod.run(listed, capture_output=True, text=True, timeout=60, env=env)
        seen, kubelets = json.loads(done.stdout)
        assert len(kubelets) == 1 and set(kubelets) <= set(seen), (seen, kubelets)
        done = pod.run([*ROOT_NO_CAPS, *listed], capture_output=True, text=True, timeout=60, env=env)
        seen_without, why = json.loads(done.stdout)
        assert isinstance(why, str) and seen_without == seen, (seen_without, why)
        done = pod.run([*NOBODY, *argv], capture_output=True, text=True, timeout=60, env=env)
        why = json.loads(done.stdout)
        assert isinstance(why, str) and f"pid {k.pid} ({name}): which process listens on kubelet.sock" in why


def test_where_the_kubelet_listens_is_not_told_by_a_name(ns: Netns, short_tmp: str) -> None:
    """hami-initcheck's PATH_MISMATCH reads the listeners among the kubelet's descriptors in the kubelet's
    own table, from another network namespace (HAMi's pod has no hostNetwork; psutil read the reader's
    table there and found no listener at all): a line made up with the inode of the kubelet's real
    listener adds no path, and a line of two words stops nothing (psutil's parser raised RuntimeError)."""

    folder = os.path.join(short_tmp, "var-lib-kubelet-device-plugins-of-a-long-name")  # see below
    os.mkdir(folder)
    kubelet = os.path.join(folder, "kubelet.sock")
    name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
    with Holder([comm(name), listen(kubelet)], ns.command([])) as k:
        (listener,) = read_proc_net_unix(f"/proc/{k.pid}", {kubelet}).sockets
        lies = [
            b"\0\nx y",
            b"\0\n"
            + kernel_line("01", "00010000", listener.ino, "/var/lib/kubelet/device-plugins/kubelet.sock"),
        ]
        with Holder(names(*lies), ns.command([])):
            found = listening_paths(kubelet, name)
    assert (found.pid, found.paths) == (k.pid, (kubelet,))
    # The real line is long enough never to be taken for a part of a name printed before it. A short one
    # may be, wherever the kernel prints it: then where the kubelet listens cannot be told, and the check
    # is skipped, never failed.
    header = PROC_HEADER + b"\n"
    real = kernel_line("01", "00010000", 12345, "/k.sock") + b"\n"
    host = kernel_line("03", "00000000", 999999, "@") + b"\n" + b"x y\n"
    lines = (header + host + real).splitlines(keepends=True)
    assert "cannot be told" in str(listeners(parse_proc_net_unix(lines), {12345}))
    assert listeners(parse_proc_net_unix((header + real + host).splitlines(keepends=True)), {12345}) == (
        "/k.sock",
    )
    assert listeners(parse_proc_net_unix(lines), {1}) == ()


# -- look-alikes: a neighbour's pair at the plugin's path, a process named as the kubelet -----------------
READ_ALL = (
    "import json, sys; from hami_guard.node.unixdiag import kubelet_connections as k; "
    "c = k(sys.argv[1], names={sys.argv[2]}, served=sys.argv[3:]); "
    "print(json.dumps(c if isinstance(c, str) else "
    "{'source': c.source, 'held': [c.held(p) for p in sys.argv[3:]], 'ignored': list(c.ignored)}))"
)


class Layout:
    """A node: the kubelet (a root process of a kubelet's name) in a network namespace of its own (the
    host's), listening on kubelet.sock and connected to one plugin ("held") and not to the other
    ("dropped"); both plugins serve from a pod's network namespace (HAMi's, with hostPID), or from the
    host's (hostNetwork). The readers run in the pod's, or in the host's."""

    def __init__(self, short_tmp: str, node: Netns, pod: Netns) -> None:
        os.chmod(short_tmp, 0o755)
        self.folder = os.path.join(short_tmp, "device-plugins")
        os.mkdir(self.folder)
        os.chmod(self.folder, 0o777)
        self.kubelet = os.path.join(self.folder, "kubelet.sock")
        self.held, self.dropped = (os.path.join(self.folder, n) for n in ("held.sock", "dropped.sock"))
        self.name = f"kubelet-{os.path.basename(short_tmp)[-6:]}"
        self.node, self.pod = node, pod
        head, self.env = reader(short_tmp)
        self.argv = [*head, self.kubelet, self.name, self.held, self.dropped]
        self.argv[2] = READ_ALL

    def read(self, where: Netns, enter: Sequence[str] = ()) -> Any:
        done = where.run([*enter, *self.argv], capture_output=True, text=True, timeout=60, env=self.env)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


@pytest.fixture
def layout(short_tmp: str) -> Iterator[Layout]:
    netns.require()
    with Netns() as node, Netns() as pod:
        yield Layout(short_tmp, node, pod)


@pytest.mark.parametrize("route", ["sock_diag", "proc"])
def test_a_look_alike_pair_at_a_plugins_path_is_never_the_kubelets(layout: Layout, route: str) -> None:
    """An unprivileged user of the host's network namespace takes user and mount namespaces of its own
    (`unshare -U -r -m`), mounts a tmpfs over the folder, binds each plugin's path there, connects,
    accepts and closes the listener: an accepted end at the plugin's path, with nothing listening.
    sock_diag knows it by its file (another device, another inode); /proc by who holds it (not the
    plugin's process, which accepted the kubelet's). Without CAP_SYS_PTRACE /proc cannot read who
    holds it: a positive count is unknown, and the attack can only make a zero unknown. Nothing is left
    once the neighbour goes."""
    lay = layout
    where = lay.node if route == "sock_diag" else lay.pod
    kubelet_ops = [comm(lay.name), listen(lay.kubelet), connect(lay.held)]
    *user, python = unprivileged()
    attacker = [*nsenter(lay.node.pid), *user, *in_a_mount_namespace(lay.folder, user=True, python=python)]
    with (
        Holder([serve(lay.held), serve(lay.dropped)], where.command([])),
        Holder(kubelet_ops, lay.node.command([])) as k,  # it connects once the plugins serve
    ):
        ours = (
            "this network namespace (sock_diag)"
            if route == "sock_diag"
            else f"the kubelet's network namespace (/proc/{k.pid}/net/unix)"
        )

        def readings() -> tuple[Any, Any]:
            return lay.read(where), lay.read(where, ROOT_NO_CAPS)

        before = readings()
        assert before[0] == {"source": ours, "held": [1, 0], "ignored": []}
        if route == "sock_diag":  # by the file's inode, with or without the kubelet's descriptors
            assert before[1] == before[0]
        else:  # the plugin's descriptors cannot be read: a connection by path is no count; none is 0
            assert before[1]["source"] == ours
            held, dropped = before[1]["held"]
            assert "by path only" in held and "needs CAP_SYS_PTRACE" in held, held
            assert dropped == 0
        with Holder([pair(lay.held), pair(lay.dropped)], attacker) as a:
            with open(f"/proc/{a.pid}/net/unix", "rb") as f:  # the pairs, by path, in the host's table
                assert f.read().count(b" 03 ") >= 4
            during = readings()
            assert during[0] == before[0]
            if route == "sock_diag":
                assert during[1] == before[0]
            else:
                held, dropped = during[1]["held"]
                assert "2 connection(s) to held.sock by path only" in held, held
                assert "1 connection(s) to dropped.sock by path only" in dropped, (
                    dropped
                )  # 0 no more: unknown
        assert readings() == before


@pytest.mark.parametrize("route", ["sock_diag", "proc"])
def test_a_root_process_named_kubelet_in_another_runtimes_container_is_ignored(
    layout: Layout, route: str
) -> None:
    """A root process with the kubelet's name, outside any pod's cgroup, in network and mount namespaces
    of its own (a container another runtime runs): it binds kubelet.sock and the plugins' paths on a
    tmpfs of its own, listens, and connects to them. It does not listen on the kubelet.sock the readers
    see (SO_PEERCRED says whose listener that is): its namespace is never read, and it is named as
    ignored. Nothing is left once it goes."""
    lay = layout
    where = lay.node if route == "sock_diag" else lay.pod
    kubelet_ops = [comm(lay.name), listen(lay.kubelet), connect(lay.held)]
    with (
        Netns() as other,
        Holder([serve(lay.held), serve(lay.dropped)], where.command([])),
        Holder(kubelet_ops, lay.node.command([])) as k,
    ):
        before = lay.read(where)
        assert before["held"] == [1, 0] and before["ignored"] == []
        fake_ops = [comm(lay.name), listen(lay.kubelet), *names(lay.held.encode()), pair(lay.dropped)]
        with Holder(fake_ops, other.command(in_a_mount_namespace(lay.folder, user=False))) as fake:
            during = lay.read(where)
            why = f"it does not listen on kubelet.sock as this pod sees it (pid {k.pid} does)"
            assert during == {**before, "ignored": [f"pid {fake.pid} ({lay.name}): {why}"]}
        assert lay.read(where) == before


def test_the_kubelet_under_another_name_is_the_process_that_listens(layout: Layout) -> None:
    """The only process of the kubelet's name a look-alike, the real kubelet running under another name
    (as root, outside any pod): the readers read the namespace of the process that listens on
    kubelet.sock, never the look-alike's, and name the look-alike. Run by nobody, the process that
    listens is no kubelet: no namespace is read, not even pid 1's (where a kubelet of the machine may
    listen at the default path), and the readers say why."""
    lay = layout
    fake_ops = [comm(lay.name), listen(lay.kubelet), *names(lay.held.encode())]
    with Netns() as other:
        with (
            Holder([serve(lay.held), serve(lay.dropped)], lay.pod.command([])),
            Holder([listen(lay.kubelet), connect(lay.held)], lay.node.command([])) as real,  # named python
            Holder(fake_ops, other.command(in_a_mount_namespace(lay.folder, user=False))) as fake,
        ):
            why = f"it does not listen on kubelet.sock as this pod sees it (pid {real.pid} does)"
            assert lay.read(lay.pod) == {
                "source": f"the kubelet's network namespace (/proc/{real.pid}/net/unix)",
                "held": [1, 0],
                "ignored": [f"pid {fake.pid} ({lay.name}): {why}"],
            }
        os.unlink(lay.kubelet)
        with (
            Holder([listen(lay.kubelet)], lay.node.command(NOBODY)) as real,
            Holder(fake_ops, other.command(in_a_mount_namespace(lay.folder, user=False))) as fake,
        ):
            why = f"it does not listen on kubelet.sock as this pod sees it (pid {real.pid} does)"
            assert lay.read(lay.pod) == f"no kubelet process is known: pid {fake.pid} ({lay.name}): {why}"


def test_listed_inodes_names_every_socket_of_the_table_and_drops_a_closed_one(tmp_path: Path) -> None:
    path = str(tmp_path / "plugin.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    accepted, _ = listener.accept()
    ids = {os.fstat(s.fileno()).st_ino for s in (listener, client, accepted)}
    try:
        assert ids <= listed_inodes("/proc/self/net/unix")
        gone = os.fstat(accepted.fileno()).st_ino
        accepted.close()
        assert gone not in listed_inodes("/proc/self/net/unix")
    finally:
        for s in (listener, client, accepted):
            s.close()


def test_listed_inodes_reads_a_table_past_its_first_read(tmp_path: Path) -> None:
    """A host's table is larger than one read: the inodes of its last lines count too."""
    line = "0000000000000000: 00000003 00000000 00000000 0001 03 {} /var/lib/kubelet/device-plugins/x.sock\n"
    table = tmp_path / "unix"
    header = "Num       RefCount Protocol Flags    Type St Inode Path\n"
    table.write_text(header + "".join(line.format(100_000 + i) for i in range(4_000)))
    assert table.stat().st_size > 4 << 16
    assert listed_inodes(str(table)) == frozenset(range(100_000, 104_000))
