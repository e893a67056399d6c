"""The checks of `kubelet.sock`, each a function from what is on the node to a `Finding`.

Standard library only: this runs at every plugin start on every node. Which process is the kubelet
is `hami_guard.node.proc`'s rule (the sidecar's and the doctor's too); where it listens is read by
`hami_guard.node.kubelet`, imported only when the kubelet's process is known.
"""

from __future__ import annotations

import errno
import os
import shlex
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from hami_guard.node.proc import kubelet_names, kubelet_pids, kubelet_processes, no_kubelet, not_listening
from hami_guard.node.sockets import DEFAULT_DIR, DEFAULT_KUBELET_PROCESS, try_connect

if TYPE_CHECKING:
    from typing import Literal

    Status = Literal["pass", "fail", "warn", "skip"]

CAP_DAC_OVERRIDE = 1


# NamedTuple rather than dataclass: dataclasses costs ~6 ms of imports at every plugin start.
class Finding(NamedTuple):
    id: str
    status: Status
    path: str
    found: str = ""
    expected: str = ""
    remedy: str = ""
    # PATH_MISMATCH: the processes of a kubelet's name that are not the kubelet, "pid N (name): why".
    ignored: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "id": self.id,
            "status": self.status,
            "path": self.path,
            "evidence": {"found": self.found, "expected": self.expected},
            "remedy": self.remedy,
        }
        if self.ignored:
            out["ignored"] = list(self.ignored)
        return out


class Options(NamedTuple):
    socket_path: str
    plugin_uid: int
    plugin_gid: int
    plugin_groups: tuple[int, ...] = ()
    expect_owner: int | None = None
    expect_group: int | None = None
    expect_mode: int | None = None
    connect: bool = True
    strict: bool = False
    kubelet_process: str = DEFAULT_KUBELET_PROCESS
    proc: str = "/proc"  # where the process table is read (a test gives one of its own)

    @property
    def folder(self) -> str:
        return os.path.dirname(self.socket_path)


def options_for(
    socket_path: str,
    *,
    plugin_uid: int | None = None,
    plugin_gid: int | None = None,
    expect_owner: int | None = None,
    expect_group: int | None = None,
    expect_mode: int | None = None,
    connect: bool = True,
    strict: bool = False,
    kubelet_process: str = DEFAULT_KUBELET_PROCESS,
    proc: str = "/proc",
) -> Options:
    """Options for the plugin's identity; absent, it is this process's (with its supplementary groups)."""
    own_identity = plugin_uid is None and plugin_gid is None
    return Options(
        socket_path=os.path.abspath(socket_path),
        plugin_uid=os.geteuid() if plugin_uid is None else plugin_uid,
        plugin_gid=os.getegid() if plugin_gid is None else plugin_gid,
        plugin_groups=tuple(os.getgroups()) if own_identity else (),
        expect_owner=expect_owner,
        expect_group=expect_group,
        expect_mode=expect_mode,
        connect=connect,
        strict=strict,
        kubelet_process=kubelet_process,
        proc=proc,
    )


def check_folder(o: Options) -> Finding:
    folder = o.folder
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return missing_folder(folder)
    except OSError as e:
        return os_failure(o, e)
    if not stat.S_ISDIR(st.st_mode):
        return Finding(
            "DIR_NOT_DIRECTORY",
            "fail",
            folder,
            _kind(st.st_mode),
            "a folder",
            f"remove {q(folder)} on the host and restart the kubelet, which creates the folder",
        )
    return Finding("DIR_MISSING", "pass", folder, "folder")


def check_exists(o: Options) -> Finding:
    try:
        os.lstat(o.socket_path)
    except FileNotFoundError:
        return missing_socket(o.socket_path)
    except OSError as e:
        return os_failure(o, e)
    return Finding("SOCKET_MISSING", "pass", o.socket_path, "exists")


def missing_folder(folder: str) -> Finding:
    return Finding(
        "DIR_MISSING",
        "fail",
        folder,
        "no such folder",
        "the kubelet's device-plugins folder",
        f"mount the host's device-plugins folder at {folder} (hostPath volume; HAMi chart value "
        "devicePlugin.pluginPath), or pass --device-plugin-dir with the path the kubelet uses",
    )


def missing_socket(path: str, vanished: bool = False) -> Finding:
    return Finding(
        "SOCKET_MISSING",
        "fail",
        path,
        "nothing (it vanished during the check: the kubelet is restarting)" if vanished else "nothing",
        "the kubelet's registration socket",
        "check that the kubelet runs on this node (systemctl status kubelet; k3s: systemctl status k3s "
        "or k3s-agent; microk8s: snap services microk8s) and that the hostPath volume is the folder it "
        "uses; with --wait N the check waits for the kubelet to create it",
    )


def os_failure(o: Options, e: OSError) -> Finding:
    """An OSError met while looking at the folder or the socket, as the finding it stands for.

    A file that vanished is missing (a restarting kubelet: --wait waits for it), a refused
    look is a permission problem (never "missing"), a path through a non-folder is
    DIR_NOT_DIRECTORY; anything else is said as the kernel said it.
    """
    path = o.socket_path
    if e.errno == errno.ENOENT:
        if not os.path.isdir(o.folder):
            return missing_folder(o.folder)
        return missing_socket(path, vanished=True)
    if e.errno in (errno.EACCES, errno.EPERM):
        return blocked(o)
    if e.errno == errno.ENOTDIR:
        return Finding(
            "DIR_NOT_DIRECTORY",
            "fail",
            o.folder,
            f"a part of the path is not a folder ({e.strerror})",
            "a folder",
            f"check every part of {q(o.folder)} on the host: each must be a folder",
        )
    return Finding(
        "NOT_A_SOCKET",
        "fail",
        path,
        f"cannot look at it: {e.strerror or e}",
        "a Unix socket",
        f"look at {q(path)} on the host (ls -l {q(path)}); remove it if it is not the kubelet's socket "
        "and restart the kubelet",
    )


def blocked(o: Options) -> Finding:
    """This process may not look at the socket: which folder of the path stops it, and why."""
    uid, gid = os.geteuid(), os.getegid()
    groups = {gid, *os.getgroups()}
    folder = "/"
    for part in o.socket_path.strip("/").split("/")[:-1]:
        try:
            st = os.stat(folder)
        except OSError:
            break
        if not _allowed(st, uid, groups, 0o1) and not has_capability(CAP_DAC_OVERRIDE):
            return Finding(
                "PERMISSION_DENIED",
                "fail",
                folder,
                f"uid {uid} gid {gid} cannot enter {folder} ({_perm(st)})",
                "search (x) permission on every folder of the socket's path",
                "run the plugin and hami-initcheck as root (securityContext.runAsUser: 0), or on the host: "
                f"chmod o+x {q(folder)}",
            )
        folder = os.path.join(folder, part)
    return Finding(
        "PERMISSION_DENIED",
        "fail",
        o.socket_path,
        f"uid {uid} gid {gid} may not look at it although every folder's mode allows it",
        "access to the socket's path",
        _selinux,
    )


def check_is_socket(o: Options) -> Finding:
    path = o.socket_path
    lst = os.lstat(path)
    found = _kind(lst.st_mode)
    if stat.S_ISLNK(lst.st_mode):
        target = os.readlink(path)
        try:
            st = os.stat(path)
        except OSError:
            found = f"dangling symlink to {target}"
        else:
            if stat.S_ISSOCK(st.st_mode):
                return Finding("NOT_A_SOCKET", "pass", path, f"symlink to a socket ({target})")
            found = f"symlink to a {_kind(st.st_mode)} ({target})"
    elif stat.S_ISSOCK(lst.st_mode):
        return Finding("NOT_A_SOCKET", "pass", path, "socket")
    return Finding(
        "NOT_A_SOCKET",
        "fail",
        path,
        found,
        "a Unix socket",
        f"remove it on the host (rm -- {q(path)}) and restart the kubelet (systemctl restart kubelet) so "
        "it listens there again",
    )


def check_expectations(o: Options) -> list[Finding]:
    st = os.stat(o.socket_path)
    path = o.socket_path
    out: list[Finding] = []
    for fid, want, have, fix in (
        ("OWNER_MISMATCH", o.expect_owner, st.st_uid, f"chown {o.expect_owner} {q(path)}"),
        ("GROUP_MISMATCH", o.expect_group, st.st_gid, f"chgrp {o.expect_group} {q(path)}"),
        ("MODE_MISMATCH", o.expect_mode, stat.S_IMODE(st.st_mode), f"chmod {o.expect_mode or 0:o} {q(path)}"),
    ):
        if want is None:
            out.append(Finding(fid, "skip", path, "not asked for (--expect-*)"))
        elif want == have:
            out.append(Finding(fid, "pass", path, _show(fid, have)))
        else:
            out.append(Finding(fid, "fail", path, _show(fid, have), _show(fid, want), fix))
    return out


def check_permission(o: Options) -> Finding:
    """Can the plugin's identity connect? Search on every folder of the path, write on the socket."""
    path = o.socket_path
    who = f"uid {o.plugin_uid} gid {o.plugin_gid}"
    if o.plugin_uid == 0 and has_capability(CAP_DAC_OVERRIDE):
        return Finding("PERMISSION_DENIED", "pass", path, f"{who} with CAP_DAC_OVERRIDE")
    groups = {o.plugin_gid, *o.plugin_groups}
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(folder)
        if not _allowed(st, o.plugin_uid, groups, 0o1):
            return Finding(
                "PERMISSION_DENIED",
                "fail",
                folder,
                f"{who} cannot enter {folder} ({_perm(st)})",
                "search (x) permission on every folder of the socket's path",
                f"run the plugin as root (securityContext.runAsUser: 0) or chmod o+x {q(folder)} on the host",
            )
        if folder == "/":
            break
        folder = os.path.dirname(folder)
    st = os.stat(path)
    if _allowed(st, o.plugin_uid, groups, 0o2):
        return Finding("PERMISSION_DENIED", "pass", path, f"{who} may write ({_perm(st)})")
    return Finding(
        "PERMISSION_DENIED",
        "fail",
        path,
        f"{_perm(st)}: {who} has no write permission",
        f"write permission for {who} (connect() on a Unix socket needs it)",
        "run the plugin as root (securityContext.runAsUser: 0), or give its group write access: "
        f"chgrp {o.plugin_gid} {q(path)} && chmod g+w {q(path)}",
    )


def check_mode_open(o: Options) -> Finding:
    st = os.stat(o.socket_path)
    if not st.st_mode & stat.S_IWOTH:
        return Finding("MODE_TOO_OPEN", "pass", o.socket_path, f"mode {stat.S_IMODE(st.st_mode):04o}")
    return Finding(
        "MODE_TOO_OPEN",
        "fail" if o.strict else "warn",
        o.socket_path,
        f"mode {stat.S_IMODE(st.st_mode):04o}: any process on the node may register a device plugin",
        "not world-writable (0755 or 0770)",
        f"chmod o-w {q(o.socket_path)}, and find what loosened it (the kubelet creates it 0755 under umask "
        "022)",
    )


def check_connect(o: Options) -> Finding:
    if not o.connect:
        return Finding("STALE_SOCKET", "skip", o.socket_path, "--no-connect")
    err = try_connect(o.socket_path)
    if err is None:
        return Finding("STALE_SOCKET", "pass", o.socket_path, "connect() accepted")
    if err == errno.ENOENT:
        return missing_socket(o.socket_path, vanished=True)
    if err == errno.ECONNREFUSED:
        return Finding(
            "STALE_SOCKET",
            "fail",
            o.socket_path,
            "connect() refused: nothing listens on this file",
            "the kubelet listening",
            "the file outlived its kubelet: restart the kubelet (systemctl restart kubelet), which deletes "
            "it and listens again; with --wait N the check waits for that",
        )
    if err in (errno.EACCES, errno.EPERM):
        return Finding(
            "PERMISSION_DENIED",
            "fail",
            o.socket_path,
            f"connect() denied ({os.strerror(err)}) although the mode allows it",
            "connect() accepted",
            _selinux,
        )
    return Finding(
        "STALE_SOCKET", "fail", o.socket_path, f"connect() failed: {os.strerror(err)}", "accepted", ""
    )


def check_kubelet_path(o: Options) -> Finding:
    """Does the kubelet listen on this socket? The kubelet is the process of a kubelet's name that
    listens on it (`hami_guard.node.proc`); the others are named as ignored. None that does, or none
    visible: not checked (skip), never a failure."""
    names = kubelet_names(o.kubelet_process)
    if not kubelet_pids(o.proc, names):
        return Finding("PATH_MISMATCH", "skip", o.socket_path, no_kubelet(names))
    if not o.connect:
        return Finding(
            "PATH_MISMATCH",
            "skip",
            o.socket_path,
            "--no-connect: which process listens on kubelet.sock is not asked (a connection tells it), "
            "so where the kubelet listens was not checked",
        )
    kubelets = kubelet_processes(o.socket_path, o.proc, names)
    if not kubelets.trusted:
        return Finding("PATH_MISMATCH", "skip", o.socket_path, not_listening(names), ignored=kubelets.ignored)
    from hami_guard.node.kubelet import KubeletLookupError, listening_paths  # noqa: PLC0415  # start-up cost

    try:
        found = listening_paths(o.socket_path, o.kubelet_process, o.proc, kubelets)
    except KubeletLookupError as e:
        return Finding("PATH_MISMATCH", "skip", o.socket_path, str(e), ignored=e.ignored)
    if found.matches(o.socket_path):
        return Finding(
            "PATH_MISMATCH",
            "pass",
            o.socket_path,
            f"kubelet pid {found.pid} listens here",
            ignored=found.ignored,
        )
    listening = ", ".join(found.paths) or "no Unix socket"
    who = "kubelet" if found.process == "kubelet" else f"kubelet (inside {found.process})"
    return Finding(
        "PATH_MISMATCH",
        "fail",
        o.socket_path,
        f"{who} pid {found.pid} listens on: {listening}",
        f"the kubelet listening on {o.socket_path}",
        path_remedy(o.socket_path, found.paths, found.distribution),
        found.ignored,
    )


# Where each distribution's kubelet listens for device plugins. The path is compiled into the
# kubelet and follows no --root-dir (docs/kubelet.md#socket-path): the same on all of them.
DEVICE_PLUGIN_DIRS = {
    "kubelet": DEFAULT_DIR,
    "k3s": DEFAULT_DIR,
    "rke2": DEFAULT_DIR,
    "microk8s": DEFAULT_DIR,
}
# Folders people mount instead, each wrong today.
WRONG_DIRS = {
    "k3s": "/var/lib/rancher/k3s/agent/kubelet/device-plugins (an old k3s layout, k3s issue 1390)",
    "microk8s": "/var/snap/microk8s/common/var/lib/kubelet/device-plugins (its root-dir: only pod-resources "
    "moves there)",
}


def path_remedy(path: str, listening: tuple[str, ...], dist: str) -> str:
    """Mount the folder the kubelet really listens in: named from what it listens on."""
    name = os.path.basename(path)

    def rank(p: str) -> tuple[bool, bool]:  # the same name in a device-plugins folder first
        return os.path.basename(os.path.dirname(p)) != "device-plugins", os.path.basename(p) != name

    same = sorted(
        (p for p in listening if os.path.basename(p) == name or "/device-plugins/" in p), key=rank
    )  # never pod-resources/kubelet.sock, which has the same name
    same = [p for p in same if "/pod-resources/" not in p]
    folder = os.path.dirname(same[0]) if same else DEVICE_PLUGIN_DIRS.get(dist, DEFAULT_DIR)
    where = f"where this {dist} kubelet listens" if same else f"where a {dist} kubelet listens"
    remedy = (
        f"mount the host folder {folder} ({where}) at {os.path.dirname(path)} "
        f"in the plugin's pod (HAMi chart: devicePlugin.pluginPath={folder}), or pass --kubelet-socket "
        "with the kubelet's path"
    )
    if dist in WRONG_DIRS:
        remedy += f"; not {WRONG_DIRS[dist]}"
    return remedy


def run_checks(o: Options) -> list[Finding]:
    """Every check in the spec's order; a failed gate (folder, file, socket) stops the rest.

    Each check looks at the file again, and a restarting kubelet may delete it in between: an
    OSError from any check is the finding it stands for (`os_failure`), and ends the round.
    """
    findings: list[Finding] = []
    gates: tuple[Callable[[Options], Finding], ...] = (check_folder, check_exists, check_is_socket)
    try:
        for gate in gates:
            findings.append(gate(o))
            if findings[-1].status == "fail":
                return findings
        findings += check_expectations(o)
        steps: tuple[Callable[[Options], Finding], ...] = (check_permission, check_mode_open, check_connect)
        for step in steps:
            findings.append(step(o))
            if findings[-1].id == "SOCKET_MISSING":
                return findings
    except OSError as e:
        findings.append(os_failure(o, e))
        return findings
    findings.append(check_kubelet_path(o))
    return findings


def has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def q(path: str) -> str:
    """A path as a shell word: pasted, it names exactly that file."""
    return shlex.quote(path)


def _allowed(st: os.stat_result, uid: int, groups: set[int], bit: int) -> bool:
    if uid == st.st_uid:
        return bool(st.st_mode >> 6 & bit)
    if st.st_gid in groups:
        return bool(st.st_mode >> 3 & bit)
    return bool(st.st_mode & bit)


def _perm(st: os.stat_result) -> str:
    return f"{stat.filemode(st.st_mode)} {st.st_uid}:{st.st_gid}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "folder"),
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISFIFO, "named pipe"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "unknown file type"


def _show(fid: str, value: int) -> str:
    return (
        f"mode {value:04o}"
        if fid == "MODE_MISMATCH"
        else ("uid " if fid == "OWNER_MISMATCH" else "gid ") + str(value)
    )


_selinux = (
    "a security module denies access: check the audit log (ausearch -m avc -ts recent) and give the plugin's "
    "container the label the folder needs (securityContext.seLinuxOptions), or run it privileged"
)
