"""hami-initcheck against real files, sockets and processes in temporary folders."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from initcheck import exitcodes
from initcheck.checks import Finding, Options, options_for, os_failure
from initcheck.cli import TRANSIENT, check_with_wait, main
from tests.proctable import isolated, own_proc

PY = sys.executable

# Each check reads a process table of the test's own (tests/proctable.py): pid 1, this process and the
# processes it started, never another process of a kubelet's name on the machine. These tests start
# processes named kubelet, k3s-server and kubelite, which every check on the machine can see: each holds
# the process-table lock (tests/conftest.py), so no test that reads the machine's table sees them.
pytestmark = pytest.mark.usefixtures("process_table")


@pytest.fixture
def folder(short_tmp: str) -> str:
    os.chmod(short_tmp, 0o755)  # other users may enter, as on a node
    path = os.path.join(short_tmp, "device-plugins")
    os.mkdir(path, 0o750)
    os.chmod(path, 0o755)
    return path


@pytest.fixture
def listener(folder: str) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(folder, "kubelet.sock"))
    s.listen()
    yield s
    s.close()


def check(folder: str, *args: str) -> tuple[int, str]:
    """hami-initcheck, in this process, with a process table of this test's own."""
    out = io.StringIO()
    with own_proc() as proc:
        code = main(["--device-plugin-dir", folder, *args], out=out, proc=proc)
    return code, out.getvalue()


def failure_ids(output: str) -> list[str]:
    return [line.split()[1] for line in output.splitlines() if line.startswith("fail:")]


def test_healthy_socket_passes(folder: str, listener: socket.socket) -> None:
    code, out = check(folder)
    assert code == exitcodes.OK == 0
    assert out.splitlines()[-1].startswith(f"ok: {folder}/kubelet.sock:")


def test_dir_missing(short_tmp: str) -> None:
    code, out = check(os.path.join(short_tmp, "nope"))
    assert code == exitcodes.FAILED == 100
    assert failure_ids(out) == ["DIR_MISSING"]


def test_dir_not_directory(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "file")
    open(path, "w").close()
    code, out = check(path)
    assert (code, failure_ids(out)) == (100, ["DIR_NOT_DIRECTORY"])


def test_socket_missing(folder: str) -> None:
    code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["SOCKET_MISSING"])


@pytest.mark.parametrize("kind", ["regular file", "folder", "dangling symlink", "symlink to a regular file"])
def test_not_a_socket(folder: str, kind: str) -> None:
    path = os.path.join(folder, "kubelet.sock")
    if kind == "regular file":
        open(path, "w").close()
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "dangling symlink":
        os.symlink("/nonexistent/kubelet.sock", path)
    else:
        target = os.path.join(folder, "real-file")
        open(target, "w").close()
        os.symlink(target, path)
    code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["NOT_A_SOCKET"])
    assert f"found {kind}" in out


def test_symlink_to_a_socket_passes(folder: str, short_tmp: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(short_tmp, "real.sock"))
        s.listen()
        os.symlink(os.path.join(short_tmp, "real.sock"), os.path.join(folder, "kubelet.sock"))
        code, _ = check(folder)
    assert code == 0


def connect_as(uid: int, path: str) -> int:
    """errno of connect() from a child process that switched to uid/gid `uid` (0 on success)."""
    pid = os.fork()
    if pid == 0:  # child: only syscalls, then _exit
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
        except OSError as e:
            code = e.errno or 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create root-owned sockets and switch uid")
def test_permission_denied_for_uid_1000_on_a_root_0600_socket(folder: str, listener: socket.socket) -> None:
    path = os.path.join(folder, "kubelet.sock")
    os.chmod(path, 0o600)
    code, out = check(folder, "--plugin-uid", "1000", "--plugin-gid", "1000")
    assert (code, failure_ids(out)) == (100, ["PERMISSION_DENIED"])
    assert "srw------- 0:0" in out

    assert connect_as(1000, path) == errno.EACCES  # the kernel agrees
    os.chmod(path, 0o666)
    assert connect_as(1000, path) == 0
    code, out = check(folder, "--plugin-uid", "1000", "--plugin-gid", "1000")
    assert code == 0
    assert "warn: MODE_TOO_OPEN" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_root_passes_with_cap_dac_override(folder: str, listener: socket.socket) -> None:
    path = os.path.join(folder, "kubelet.sock")
    os.chown(path, 1000, 1000)
    os.chmod(path, 0o600)
    assert check(folder, "--plugin-uid", "0")[0] == 0
    assert check(folder, "--plugin-uid", "1001", "--plugin-gid", "1001")[0] == 100
    assert check(folder, "--plugin-uid", "1000", "--plugin-gid", "1001")[0] == 0


def test_folder_search_permission_is_checked(folder: str, listener: socket.socket) -> None:
    os.chmod(folder, 0o750)
    code, out = check(folder, "--plugin-uid", "1000", "--plugin-gid", "1000")
    assert (code, failure_ids(out)) == (100, ["PERMISSION_DENIED"])
    assert f"cannot enter {folder}" in out


def test_world_writable_socket_warns_and_fails_with_strict(folder: str, listener: socket.socket) -> None:
    os.chmod(os.path.join(folder, "kubelet.sock"), 0o777)
    code, out = check(folder)
    assert code == 0
    assert "warn: MODE_TOO_OPEN" in out
    code, out = check(folder, "--strict")
    assert (code, failure_ids(out)) == (100, ["MODE_TOO_OPEN"])


def test_stale_socket(folder: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(folder, "kubelet.sock"))
    s.listen()
    s.close()  # the file outlives its listener
    code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["STALE_SOCKET"])
    assert check(folder, "--no-connect")[0] == 0


def test_expectations_met_and_missed(folder: str, listener: socket.socket) -> None:
    os.chmod(os.path.join(folder, "kubelet.sock"), 0o750)
    uid, gid = os.geteuid(), os.getegid()
    assert (
        check(folder, "--expect-owner", str(uid), "--expect-group", str(gid), "--expect-mode", "750")[0] == 0
    )
    code, out = check(
        folder, "--expect-owner", str(uid + 1), "--expect-group", str(gid + 1), "--expect-mode", "0660"
    )
    assert (code, failure_ids(out)) == (100, ["OWNER_MISMATCH", "GROUP_MISMATCH", "MODE_MISMATCH"])
    assert "found mode 0750; expected mode 0660; fix: chmod 660" in out


def test_failure_line_has_id_path_found_expected_and_fix(folder: str) -> None:
    _, out = check(folder)
    (line,) = out.splitlines()
    assert line.startswith(f"fail: SOCKET_MISSING {folder}/kubelet.sock: found nothing; expected ")
    assert "; fix: " in line


LISTENER = (
    "import os, socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
    "os.rename(sys.argv[1], sys.argv[2]) if len(sys.argv) > 2 else None; print('ready', flush=True); "
    "time.sleep(60)"
)


@contextlib.contextmanager
def stand_in(name: str, tmp: str, bound: str, moved_to: str = "") -> Iterator[subprocess.Popen[bytes]]:
    """A real process named `name` (a link to the interpreter), listening on the socket it bound at
    `bound`; with `moved_to`, that socket file is moved there once it listens (the process still
    listens on it, and its net/unix still names `bound`)."""
    exe = os.path.join(tmp, name)
    os.makedirs(tmp, exist_ok=True)
    if not os.path.exists(exe):
        os.symlink(os.path.realpath(PY), exe)
    os.makedirs(os.path.dirname(bound), exist_ok=True)
    argv = [exe, "-c", LISTENER, bound, *([moved_to] if moved_to else [])]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_the_kubelet_is_the_process_of_its_name_that_listens_here(
    folder: str, short_tmp: str, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    """A process named kubelet that listens elsewhere (started first: the lower pid) is not the kubelet:
    it is named as ignored, and the one that listens on kubelet.sock as this pod sees it is checked."""
    other, _ = kubelet_elsewhere
    with stand_in("kubelet", os.path.join(short_tmp, "k"), os.path.join(folder, "kubelet.sock")) as kubelet:
        code, out = check(folder, "--output", "json")
        text = check(folder)[1]
    assert code == 0, out
    (path,) = [c for c in json.loads(out)["checks"] if c["id"] == "PATH_MISMATCH"]
    why = f"it does not listen on kubelet.sock as this pod sees it (pid {kubelet.pid} does)"
    assert (path["status"], path["evidence"]["found"]) == ("pass", f"kubelet pid {kubelet.pid} listens here")
    assert path["ignored"] == [f"pid {other.pid} (kubelet): {why}"]
    assert f"note: PATH_MISMATCH ignored: pid {other.pid} (kubelet): {why}" in text.splitlines()
    assert text.splitlines()[-1].startswith(f"ok: {folder}/kubelet.sock:")


def test_a_process_named_kubelet_elsewhere_is_ignored_not_a_mismatch(
    folder: str, listener: socket.socket, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    """kubelet.sock served by a process of another name, and a process named kubelet listening
    elsewhere (another kubelet on the machine: a CI runner's kind, a virtual-kubelet-style tool): no
    process of a kubelet's name listens here, so the check is skipped as with none visible (the plugin
    starts), and the other is named."""
    other, _ = kubelet_elsewhere
    code, out = check(folder)
    assert (code, failure_ids(out)) == (0, [])
    assert (
        "note: PATH_MISMATCH skipped: no process named kubelet, k3s, k3s-agent, k3s-server or kubelite "
        in out
    )
    why = f"it does not listen on kubelet.sock as this pod sees it (pid {os.getpid()} does)"
    assert f"note: PATH_MISMATCH ignored: pid {other.pid} (kubelet): {why}" in out


def test_path_mismatch_names_where_the_kubelet_listens(folder: str, short_tmp: str) -> None:
    """The kubelet listens on this very socket file, but bound it elsewhere (the file was moved since):
    the kubelet dials plugins in its own folder, not this one."""
    where = os.path.join(short_tmp, "k", "device-plugins", "kubelet.sock")
    with stand_in("kubelet", short_tmp, where, os.path.join(folder, "kubelet.sock")) as kubelet:
        code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["PATH_MISMATCH"])
    assert f"kubelet pid {kubelet.pid} listens on: {where}" in out
    assert f"mount the host folder {os.path.dirname(where)} (where this kubelet kubelet" in out


def test_path_matches_where_the_kubelet_listens(
    short_tmp: str, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    code, out = check(short_tmp, "--kubelet-socket", "elsewhere.sock", "--output", "json")
    assert code == 0
    doc = json.loads(out)
    assert [c["status"] for c in doc["checks"] if c["id"] == "PATH_MISMATCH"] == ["pass"]


def test_no_visible_kubelet_is_said_and_skipped(folder: str, listener: socket.socket) -> None:
    code, out = check(folder, "--kubelet-process-name", "no-such-kubelet")
    assert code == 0
    names = "kubelet, k3s, k3s-agent, k3s-server, kubelite or no-such-kubelet"
    assert f"note: PATH_MISMATCH skipped: no process named {names} is visible" in out
    assert "ignored" not in out


def test_no_connect_asks_no_listener(
    folder: str, listener: socket.socket, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    """Which process listens is told by a connection: --no-connect asks none, and the check is skipped."""
    code, out = check(folder, "--no-connect")
    assert code == 0
    assert (
        "note: PATH_MISMATCH skipped: --no-connect: which process listens on kubelet.sock is not asked" in out
    )


def test_json_output_shape(folder: str) -> None:
    code, out = check(folder, "--output", "json")
    doc = json.loads(out)
    assert set(doc) == {"ok", "exit_code", "kubelet_socket", "checks"}
    assert (doc["ok"], doc["exit_code"]) == (False, code) == (False, 100)
    for c in doc["checks"]:
        assert set(c) == {"id", "status", "path", "evidence", "remedy"}
        assert set(c["evidence"]) == {"found", "expected"}
        assert c["status"] in {"pass", "fail", "warn", "skip"}
    assert [c["id"] for c in doc["checks"]] == ["DIR_MISSING", "SOCKET_MISSING"]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """hami-initcheck, a process, with a process table of this test's own where root can give it one."""
    with tempfile.TemporaryDirectory(prefix="hg-") as d:
        return subprocess.run(
            isolated([PY, "-m", "initcheck", *args], os.path.join(d, "table")),
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=30,
            check=False,
        )


@pytest.fixture
def proc() -> Iterator[str]:
    """A process table of this test's own, taken when the test starts."""
    with own_proc() as table:
        yield table


def missing_socket_options(folder: str, proc: str) -> Options:
    return options_for(os.path.join(folder, "kubelet.sock"), kubelet_process="no-such-kubelet", proc=proc)


def test_wait_passes_when_the_socket_appears(folder: str, proc: str) -> None:
    path = os.path.join(folder, "kubelet.sock")
    rounds: list[list[Finding]] = []
    waiting = threading.Event()

    def on_round(findings: list[Finding]) -> None:
        rounds.append(findings)
        waiting.set()

    result: list[list[Finding]] = []
    waiter = threading.Thread(
        target=lambda: result.append(check_with_wait(missing_socket_options(folder, proc), 60, on_round))
    )
    waiter.start()
    try:
        assert waiting.wait(30), "the first round did not run"
        with socket.socket(socket.AF_UNIX) as s:  # the kubelet starts listening after the first round
            s.bind(path)
            s.listen()
            waiter.join(30)
    finally:
        waiter.join(30)
    assert not waiter.is_alive()
    assert [f.id for f in rounds[0] if f.status == "fail"] == ["SOCKET_MISSING"]
    assert len(rounds) >= 2
    assert [f.id for f in result[0] if f.status == "fail"] == []


def test_wait_gives_up_after_n_seconds(folder: str, proc: str) -> None:
    rounds: list[list[Finding]] = []
    started = time.monotonic()
    findings = check_with_wait(missing_socket_options(folder, proc), 0.3, rounds.append)
    assert time.monotonic() - started >= 0.3  # waited the whole time (how much longer is bench's business)
    assert len(rounds) >= 2  # and polled while it waited
    assert [f.id for f in findings if f.status == "fail"] == ["SOCKET_MISSING"]
    code, out = check(folder, "--wait", "0.05")
    assert (code, failure_ids(out)) == (100, ["SOCKET_MISSING"])


def test_wait_does_not_wait_out_a_failure_no_kubelet_clears(folder: str, proc: str) -> None:
    open(os.path.join(folder, "kubelet.sock"), "w").close()
    rounds: list[list[Finding]] = []
    findings = check_with_wait(missing_socket_options(folder, proc), 3600, rounds.append)
    assert len(rounds) == 1
    assert [f.id for f in findings if f.status == "fail"] == ["NOT_A_SOCKET"]


def catches(pid: int, signum: int) -> bool:
    """Has process `pid` installed a handler for `signum`? (SigCgt in /proc/<pid>/status)"""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_during_wait_exits_100_at_once(folder: str, signum: int) -> None:
    proc = subprocess.Popen(
        [PY, "-m", "initcheck", "--device-plugin-dir", folder, "--wait", "3600"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not catches(proc.pid, signal.SIGTERM):  # its handler is in place: it is waiting
            assert proc.poll() is None and time.monotonic() < deadline, "hami-initcheck did not start waiting"
            time.sleep(0.005)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)  # far less than the hour it would wait
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 100
    assert out.startswith(f"fail: {signal.Signals(signum).name} while waiting for")
    assert err == ""  # no traceback


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--expect-mode", "999"], {}, "argument --expect-mode: "),
        (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
        (["--wait", "nan"], {}, "argument --wait: "),
        (["--wait", "-1"], {}, "argument --wait: "),
        (["--wait", "86401"], {}, "argument --wait: "),
        (["--plugin-uid", "4294967295"], {}, "argument --plugin-uid: "),
        ([], {"HAMI_GUARD_PLUGIN_UID": "root"}, "HAMI_GUARD_PLUGIN_UID='root'"),
        ([], {"HAMI_GUARD_WAIT": "inf"}, "HAMI_GUARD_WAIT='inf'"),
        # An argument's newline is escaped: it cannot forge a line of its own.
        (["x\nfail: FAKE"], {}, "unrecognized arguments: x\\nfail: FAKE"),
        (["--wait", "1\nfail: FAKE"], {}, "argument --wait: "),
    ],
)
def test_exit_code_2_for_usage_errors_in_one_line(args: list[str], env: dict[str, str], named: str) -> None:
    result = run_cli(*args, env=env)
    assert result.returncode == exitcodes.USAGE == 2
    assert result.stderr.startswith("hami-initcheck: error: ")
    assert named in result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_environment_twins_and_a_flag_wins(folder: str, short_tmp: str, listener: socket.socket) -> None:
    env = {"HAMI_GUARD_DEVICE_PLUGIN_DIR": folder, "HAMI_GUARD_OUTPUT": "json", "HAMI_GUARD_CONNECT": "false"}
    result = run_cli(env=env)
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["kubelet_socket"] == os.path.join(folder, "kubelet.sock")
    assert [c["status"] for c in doc["checks"] if c["id"] == "STALE_SOCKET"] == ["skip"]
    # The flag wins over its twin.
    result = run_cli("--device-plugin-dir", short_tmp, "--output", "text", env=env)
    assert result.returncode == 100
    assert result.stdout.startswith(f"fail: SOCKET_MISSING {short_tmp}/kubelet.sock")


def test_only_the_standard_library_is_imported(
    folder: str, short_tmp: str, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    code = (
        "import sys\nfrom initcheck.cli import main\n"
        "import io\nrc = main(sys.argv[1:], out=io.StringIO())\n"
        "print(rc, sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'aiohttp', 'watchdog', 'psutil', "
        "'sidecar', 'google', 'tomllib', 'json'}))"  # tomllib: the vendor profiles, never read here
    )

    def imported(*args: str) -> list[str]:
        with tempfile.TemporaryDirectory(prefix="hg-") as d:
            argv = isolated([PY, "-c", code, *args], os.path.join(d, "table"))
            result = subprocess.run(argv, capture_output=True, text=True, check=True)
        return result.stdout.split(maxsplit=1)

    # The kubelet listens here: where it listens is read from /proc, with the standard library alone.
    with stand_in("kubelet", os.path.join(short_tmp, "k"), os.path.join(folder, "kubelet.sock")):
        assert imported("--device-plugin-dir", folder) == ["0", "[]\n"]
    os.unlink(os.path.join(folder, "kubelet.sock"))
    # A kubelet elsewhere, none, or the socket missing: nothing more.
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(folder, "kubelet.sock"))
        s.listen()
        assert imported("--device-plugin-dir", folder) == ["0", "[]\n"]
    assert imported("--device-plugin-dir", folder + "x") == ["100", "[]\n"]
    # json only for --output json.
    assert imported("--device-plugin-dir", folder + "x", "--output", "json") == ["100", "['json']\n"]


# -- races, refused looks and hostile names --------------------------------------------------------------
FLIPPER = """
import os, socket, sys, time
path, period = sys.argv[1], float(sys.argv[2])
print("ready", flush=True)
while True:  # a kubelet restarting every `period`: its file dies, goes, and a new one listens
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen()
    time.sleep(period)
    s.close()  # a dead file, refusing connections
    time.sleep(period / 12)
    os.unlink(path)  # the new kubelet cleans the folder
    time.sleep(period / 12)
"""


@pytest.fixture
def flipping_kubelet(folder: str) -> Iterator[str]:
    """A process that deletes and re-creates `kubelet.sock` every 3 ms, for as long as the test runs."""
    path = os.path.join(folder, "kubelet.sock")
    proc = subprocess.Popen([PY, "-c", FLIPPER, path, "0.003"], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    try:
        yield path
    finally:
        proc.kill()
        proc.wait()


def test_a_kubelet_restarting_every_3_ms_never_breaks_the_exit_code_contract(
    folder: str, flipping_kubelet: str, proc: str
) -> None:
    """200 runs against a kubelet.sock re-created every 3 ms: each ends 0 or 100 with findings, none
    raises; a socket that vanished mid-run is SOCKET_MISSING (which --wait waits out), never a crash."""
    codes: Counter[int] = Counter()
    seen: Counter[str] = Counter()
    argv = ["--device-plugin-dir", folder, "--kubelet-process-name", "none"]
    for _ in range(200):
        out = io.StringIO()
        codes[main([*argv, "--wait", "1"], out, proc)] += 1
        seen.update(failure_ids(out.getvalue()))
    assert set(codes) <= {0, 100}, codes
    assert set(seen) <= {"SOCKET_MISSING", "STALE_SOCKET"}, seen
    # Without --wait each run reports what it met: every failure is one a restarting kubelet explains.
    for _ in range(100):
        out = io.StringIO()
        codes[main(argv, out, proc)] += 1
        seen.update(failure_ids(out.getvalue()))
    assert set(codes) <= {0, 100}, codes
    assert set(seen) <= {"SOCKET_MISSING", "STALE_SOCKET"}, seen
    # The same through real processes, in a small batch: exit codes only from the contract, no traceback.
    for _ in range(5):
        result = run_cli(*argv, "--wait", "1")
        assert result.returncode in (0, 100), result
        assert "Traceback" not in result.stderr


def test_each_os_error_is_the_finding_it_stands_for(folder: str) -> None:
    o = options_for(os.path.join(folder, "kubelet.sock"), kubelet_process="none")
    vanished = os_failure(o, FileNotFoundError(errno.ENOENT, "No such file or directory"))
    assert (vanished.id, vanished.status) == ("SOCKET_MISSING", "fail")
    assert "vanished during the check" in vanished.found
    assert vanished.id in TRANSIENT  # --wait waits for the kubelet's new socket
    gone = options_for(os.path.join(folder, "gone", "kubelet.sock"), kubelet_process="none")
    assert os_failure(gone, FileNotFoundError(errno.ENOENT, "x")).id == "DIR_MISSING"
    assert os_failure(o, NotADirectoryError(errno.ENOTDIR, "x")).id == "DIR_NOT_DIRECTORY"
    odd = os_failure(o, OSError(errno.ELOOP, "Too many levels of symbolic links"))
    assert (odd.id, odd.found) == ("NOT_A_SOCKET", "cannot look at it: Too many levels of symbolic links")
    assert os_failure(o, PermissionError(errno.EACCES, "x")).id == "PERMISSION_DENIED"


def test_a_symlink_loop_is_a_finding(folder: str) -> None:
    os.symlink("kubelet.sock", os.path.join(folder, "kubelet.sock"))
    code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["NOT_A_SOCKET"])


def without_dac(*argv: str) -> subprocess.CompletedProcess[str]:
    """hami-initcheck as root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: folder modes bind it."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root with setpriv (util-linux)")
        pytest.skip("needs root and setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    caps = "--bounding-set=-dac_override,-dac_read_search"
    return subprocess.run(
        [setpriv, caps, "--", PY, "-m", "initcheck", *argv], capture_output=True, text=True, timeout=60
    )


def test_a_folder_the_plugin_cannot_search_is_permission_denied_not_missing(
    folder: str, listener: socket.socket, short_tmp: str
) -> None:
    os.chmod(short_tmp, 0)  # the socket exists; the folder above it cannot be searched
    try:
        started = time.monotonic()
        result = without_dac("--device-plugin-dir", folder, "--wait", "60", "--kubelet-process-name", "none")
        waited = time.monotonic() - started
    finally:
        os.chmod(short_tmp, 0o755)
    assert result.returncode == 100, result
    assert failure_ids(result.stdout) == ["PERMISSION_DENIED"], result.stdout
    assert f"cannot enter {short_tmp} (d---------" in result.stdout
    assert "SOCKET_MISSING" not in result.stdout and "selinux" not in result.stdout.lower()
    assert waited < 30  # not waited out: no kubelet clears a permission (a bound far below the 60 s wait)


@pytest.mark.parametrize("name", ["x;touch${IFS}PWNED;.sock", "a b.sock", "$(touch PWNED).sock", "-rf.sock"])
def test_printed_commands_are_shell_quoted(folder: str, short_tmp: str, name: str) -> None:
    path = os.path.join(folder, name)
    open(path, "w").close()  # a regular file where the socket should be
    code, out = check(folder, f"--kubelet-socket={name}", "--kubelet-process-name", "none")
    assert (code, failure_ids(out)) == (100, ["NOT_A_SOCKET"])
    command = out.split("(rm -- ", 1)[1].split(") and restart", 1)[0]
    subprocess.run(["sh", "-c", f"rm -- {command}"], cwd=short_tmp, check=True)
    assert not os.path.exists(path)
    assert not os.path.exists(os.path.join(short_tmp, "PWNED"))
    assert sorted(os.listdir(folder)) == []


@pytest.mark.parametrize(("process", "distribution"), [("k3s-server", "k3s"), ("kubelite", "microk8s")])
def test_the_kubelet_inside_k3s_and_microk8s_is_found(
    folder: str, short_tmp: str, process: str, distribution: str
) -> None:
    here = os.path.join(folder, "kubelet.sock")
    with stand_in(process, short_tmp, here) as proc:
        code, out = check(folder, "--output", "json")
    assert code == 0, out
    (path,) = [c for c in json.loads(out)["checks"] if c["id"] == "PATH_MISMATCH"]
    assert (path["status"], path["evidence"]["found"]) == ("pass", f"kubelet pid {proc.pid} listens here")
    # Bound elsewhere (the file moved since): the fix names that distribution's folder.
    where = os.path.join(short_tmp, "k", "device-plugins", "kubelet.sock")
    os.unlink(here)
    with stand_in(process, short_tmp, where, here) as proc:
        code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["PATH_MISMATCH"])
    assert f"kubelet (inside {process}) pid {proc.pid} listens on: {where}" in out
    assert f"mount the host folder {os.path.dirname(where)} (where this {distribution} kubelet" in out
