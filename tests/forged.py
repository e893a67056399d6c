"""Sockets a hostile neighbour binds in the kubelet's network namespace: abstract names that hold a
newline followed by a made-up line of `/proc/net/unix` (no file permission needed), held open by a
process of their own until it is stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Each argument is an operation: `name:<hex>` binds an abstract or file name (hex: names hold NULs and
# newlines), listens and connects to it; `listen:<hex>` only binds and listens; `serve:<hex>` also accepts
# every connection, as a plugin's gRPC server does; `connect:<hex>` connects to a listener elsewhere;
# `pair:<hex>` binds, connects and accepts, then closes the listener (a connection whose accepted end
# bears that name, with nothing listening); `comm:<name>` names the process. Then it says "ready" and
# holds every socket until stdin closes.
HOLDER = r"""
import socket, sys, threading
held = []

def serve(s):
    while True:
        held.append(s.accept()[0])

for arg in sys.argv[1:]:
    op, _, value = arg.partition(":")
    if op == "comm":
        with open("/proc/self/comm", "w") as f:
            f.write(value)
        continue
    name = bytes.fromhex(value)
    s = socket.socket(socket.AF_UNIX)
    if op == "connect":
        s.connect(name)
        held.append(s)
        continue
    s.bind(name)
    s.listen()
    held.append(s)
    if op == "serve":
        threading.Thread(target=serve, args=(s,), daemon=True).start()
    if op in ("name", "pair"):
        c = socket.socket(socket.AF_UNIX)
        c.connect(name)
        held += [c, s.accept()[0]]
    if op == "pair":
        held.remove(s)
        s.close()
print("ready", flush=True)
sys.stdin.read()
"""

SUN_PATH = 108


def kernel_line(state: str, flags: str, inode: int, path: str) -> bytes:
    """A line as the kernel prints it (af_unix.c, unix_seq_show), for a socket that does not exist."""
    return f"0000000000000000: 00000002 00000000 {flags} 0001 {state} {inode:5d} {path}".encode()


def forged_names(kubelet_path: str, plugin_path: str, bound_dir: str) -> list[bytes]:
    """The names of the report (adapted to the test's paths) and the same lie in the kernel's format,
    for the kubelet's listener and for a connection to the plugin, by either of its paths."""
    bound_kubelet = f"{bound_dir}/kubelet.sock"
    bound_plugin = f"{bound_dir}/{plugin_path.rsplit('/', 1)[1]}"
    names = [
        b"\0\nx x x 0 x 03 z " + kubelet_path.encode(),
        b"\0\nx x x 0 x 03 1 " + plugin_path.encode(),
        b"\0\nx x x 0 x 03 z " + bound_kubelet.encode(),
        b"\0\nx x x 0 x 03 1 " + bound_plugin.encode(),
        b"\0\n" + kernel_line("01", "00010000", 12345, bound_kubelet),
        b"\0\n" + kernel_line("03", "00000000", 12346, bound_plugin),
        b"\0\n" + kernel_line("03", "00000000", 12347, plugin_path),
        b"\0\n" + kernel_line("01", "00010000", 12348, kubelet_path),
        b"\0\nA\n" + kernel_line("03", "00000000", 7, plugin_path)[:100],
    ]
    return [n for n in names if len(n) <= SUN_PATH]


class Holder:
    """A process (started with the command prefix `enter`: nsenter, setpriv) doing `ops` (see HOLDER)
    and holding its sockets until `stop()`."""

    def __init__(self, ops: Sequence[str], enter: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen(
            [*enter, sys.executable, "-c", HOLDER, *ops],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.stop()
            raise RuntimeError(f"the holder did not start (exit {self.proc.returncode})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def names(*names: bytes) -> list[str]:
    """Operations binding each name (and a connection to it)."""
    return [f"name:{n.hex()}" for n in names]


def listen(path: str) -> str:
    return f"listen:{path.encode().hex()}"


def serve(path: str) -> str:
    return f"serve:{path.encode().hex()}"


def pair(path: str) -> str:
    return f"pair:{path.encode().hex()}"


def connect(path: str) -> str:
    return f"connect:{path.encode().hex()}"


def comm(name: str) -> str:
    return f"comm:{name}"


def nsenter(pid: int) -> list[str]:
    """The command prefix that runs a command in the network namespace of `pid`."""
    return ["nsenter", f"--net=/proc/{pid}/ns/net", "--"]


# Every capability dropped, as root (the sidecar as the manifests run it) and as nobody: either way no
# CAP_SYS_PTRACE, so the links of a root process's descriptors cannot be read.
ROOT_NO_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]
NOBODY = [
    "setpriv",
    "--reuid=65534",
    "--regid=65534",
    "--clear-groups",
    "--inh-caps=-all",
    "--bounding-set=-all",
    "--",
]


# With CAP_SYS_PTRACE alone: the descriptors of the kubelet and of the plugin can be read.
PTRACE_ONLY = [
    "setpriv",
    "--inh-caps=-all,+sys_ptrace",
    "--ambient-caps=-all,+sys_ptrace",
    "--bounding-set=-all,+sys_ptrace",
    "--",
]


def in_a_mount_namespace(folder: str, *, user: bool, python: str = sys.executable) -> list[str]:
    """A command prefix: a mount namespace of its own (and, with `user`, a user namespace, as any
    unprivileged user may have one) with a tmpfs over `folder`, where any path in it can be bound; the
    command's interpreter becomes `python`."""
    unshare = ["unshare", "-U", "-r", "-m"] if user else ["unshare", "-m"]
    return [*unshare, "sh", "-c", f'mount -t tmpfs none {folder} && shift && exec {python} "$@"', "sh"]


def unprivileged() -> list[str]:
    """The command prefix of an unprivileged user's own user namespace: nobody, with an interpreter
    that user may run (in a user namespace, the checkout's may be out of reach), or root where none."""
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        probe = [*NOBODY, "unshare", "-U", "-r", "-m", python, "-c", "pass"]
        if os.path.exists(python) and subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return [*NOBODY, python]
    return ["env", os.path.realpath(sys.executable)]


# A new network namespace's loopback is down: a sidecar in it could not serve HTTP on 127.0.0.1.
LOOPBACK_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "f = struct.unpack('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH22x', b'lo', 0))[:18])[1]; "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', f | 1))"
)


def loopback_up(pid: int) -> None:
    """Bring up the loopback of the network namespace of `pid` (SIOCGIFFLAGS, SIOCSIFFLAGS)."""
    subprocess.run([*nsenter(pid), sys.executable, "-c", LOOPBACK_UP], check=True, timeout=30)


# /status from inside a namespace, one line a question (a port). /status is rate limited (the serving
# limits answer 503 "busy" past their rate): a refused ask is asked again a moment later, a few times,
# never forever.
STATUS = (
    "import sys, time, urllib.request\n"
    "for port in sys.stdin:\n"
    "    for _ in range(50):\n"
    "        try:\n"
    "            body = urllib.request.urlopen(f'http://127.0.0.1:{port.strip()}/status', timeout=5).read()\n"
    "            break\n"
    "        except OSError:\n"
    "            body = b'{}'\n"
    "            time.sleep(0.05)\n"
    "    print(body.decode().replace(chr(10), ' '), flush=True)\n"
)


@contextmanager
def asking_status(
    command: Callable[[list[str]], list[str]], port: int
) -> Iterator[Callable[[], dict[str, Any]]]:
    """What reads the sidecar's /status on `port` from where `command` runs (a namespace's), a plain
    function for wait_for's predicates: one process asked, a line each time."""
    asker = subprocess.Popen(
        command([sys.executable, "-c", STATUS]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert asker.stdin is not None and asker.stdout is not None
    questions, answers = asker.stdin, asker.stdout

    def status() -> dict[str, Any]:
        questions.write(f"{port}\n")
        questions.flush()
        doc: dict[str, Any] = json.loads(answers.readline())
        return doc

    try:
        yield status
    finally:
        questions.close()
        asker.wait(10)
