"""hami-initcheck against real files, sockets and processes in temporary folders."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from initcheck import exitcodes
from initcheck.checks import Finding, Options, options_for
from initcheck.cli import check_with_wait, main

PY = sys.executable


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
    out = io.StringIO()
    code = main(["--device-plugin-dir", folder, *args], out=out)
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
    import errno

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


def test_path_mismatch_names_where_the_kubelet_listens(
    folder: str, listener: socket.socket, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    proc, where = kubelet_elsewhere
    code, out = check(folder)
    assert (code, failure_ids(out)) == (100, ["PATH_MISMATCH"])
    assert f"kubelet pid {proc.pid} listens on: {where}" in out


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
    assert "note: PATH_MISMATCH skipped: no process named no-such-kubelet is visible" in out


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
    return subprocess.run(
        [PY, "-m", "initcheck", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=30,
        check=False,
    )


def missing_socket_options(folder: str) -> Options:
    return options_for(os.path.join(folder, "kubelet.sock"), kubelet_process="no-such-kubelet")


def test_wait_passes_when_the_socket_appears(folder: str) -> None:
    path = os.path.join(folder, "kubelet.sock")
    rounds: list[list[Finding]] = []
    waiting = threading.Event()

    def on_round(findings: list[Finding]) -> None:
        rounds.append(findings)
        waiting.set()

    result: list[list[Finding]] = []
    waiter = threading.Thread(
        target=lambda: result.append(check_with_wait(missing_socket_options(folder), 60, on_round))
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


def test_wait_gives_up_after_n_seconds(folder: str) -> None:
    rounds: list[list[Finding]] = []
    started = time.monotonic()
    findings = check_with_wait(missing_socket_options(folder), 0.3, rounds.append)
    assert time.monotonic() - started >= 0.3  # waited the whole time (how much longer is bench's business)
    assert len(rounds) >= 2  # and polled while it waited
    assert [f.id for f in findings if f.status == "fail"] == ["SOCKET_MISSING"]
    code, out = check(folder, "--wait", "0.05")
    assert (code, failure_ids(out)) == (100, ["SOCKET_MISSING"])


def test_wait_does_not_wait_out_a_failure_no_kubelet_clears(folder: str) -> None:
    open(os.path.join(folder, "kubelet.sock"), "w").close()
    rounds: list[list[Finding]] = []
    findings = check_with_wait(missing_socket_options(folder), 3600, rounds.append)
    assert len(rounds) == 1
    assert [f.id for f in findings if f.status == "fail"] == ["NOT_A_SOCKET"]


def catches(pid: int, signum: int) -> bool:
    """Has process `pid` installed a handler for `signum`? (SigCgt in /proc/<pid>/status)"""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_sigterm_during_wait_exits_100_at_once(folder: str) -> None:
    proc = subprocess.Popen(
        [PY, "-m", "initcheck", "--device-plugin-dir", folder, "--wait", "3600"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not catches(proc.pid, signal.SIGTERM):  # its handler is in place: it is waiting
            assert proc.poll() is None and time.monotonic() < deadline, "hami-initcheck did not start waiting"
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)  # far less than the hour it would wait
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 100
    assert out.startswith("fail: SIGTERM while waiting for")


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


def test_only_the_standard_library_and_psutil_are_imported(
    folder: str, listener: socket.socket, kubelet_elsewhere: tuple[subprocess.Popen[bytes], str]
) -> None:
    code = (
        "import sys\nfrom initcheck.cli import main\n"
        "import io\nrc = main(sys.argv[1:], out=io.StringIO())\n"
        "print(rc, sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'aiohttp', 'watchdog', 'psutil', "
        "'sidecar', 'google'}))"
    )

    def imported(*args: str) -> list[str]:
        result = subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, check=True)
        return result.stdout.split(maxsplit=1)

    # A kubelet is visible: psutil reads where it listens (and finds it elsewhere).
    assert imported("--device-plugin-dir", folder) == ["100", "['psutil']\n"]
    # No kubelet to inspect, or the socket is missing: psutil is never loaded.
    assert imported("--device-plugin-dir", folder, "--kubelet-process-name", "nobody") == ["0", "[]\n"]
    assert imported("--device-plugin-dir", folder + "x") == ["100", "[]\n"]
