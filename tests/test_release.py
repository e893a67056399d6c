"""hami_guard.node.release: the kubelet's release from its Go binary, and nothing from anything else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hami_guard.node import release
from sidecar.deviceplugin.evidence import kubelet_rules
from testing.realkubelet import RELEASES, _binary


def fixture_binary() -> Path:
    path = _binary("new")
    if not path.exists():
        pytest.skip(f"{path} is not built (make kubelet-fixtures)")
    return path


def test_a_go_binary_names_the_kubernetes_module_it_embeds() -> None:
    info = release.buildinfo(str(fixture_binary()))
    assert release.from_buildinfo(info) == RELEASES["new"]
    assert len(info) < release.MAX_BUILDINFO


@pytest.mark.parametrize(
    ("info", "found"),
    [
        (b'\tbuild\t-ldflags="-X k8s.io/component-base/version.gitVersion=v1.33.13 -s"\n', "v1.33.13"),
        (b"path\tk8s.io/kubernetes/cmd/kubelet\nmod\tk8s.io/kubernetes\tv1.37.2\th1:x=\n", "v1.37.2"),
        (
            b"\ndep\tk8s.io/kubernetes\tv1.30.2\th1:x=\n=>\tgithub.com/k3s-io/kubernetes\tv1.30.2-k3s1\n",
            "v1.30.2",
        ),
        (b"path\tk8s.io/kubernetes/cmd/kubelet\nmod\tk8s.io/kubernetes\t(devel)\t\n", None),
        (b"\ndep\tk8s.io/kubernetes-fake\tv1.36.0\t\n", None),
    ],
)
def test_what_the_build_information_says(info: bytes, found: str | None) -> None:
    assert release.from_buildinfo(info) == found


@pytest.mark.parametrize(
    ("text", "minor"),
    [
        ("v1.37.2", (1, 37)),
        ("1.34", (1, 34)),
        ("v1.30.2+k3s1", (1, 30)),
        ("v1", None),
        ("1.x", None),
        ("", None),
    ],
)
def test_a_release_is_parsed_strictly(text: str, minor: tuple[int, int] | None) -> None:
    assert release.parse(text) == minor


def test_what_is_not_a_go_binary_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\n")
    elf = tmp_path / "truncated"
    elf.write_bytes(fixture_binary().read_bytes()[:100])
    for path, why in (
        (fifo, "not a regular file"),
        (script, "not a 64-bit little-endian ELF file"),
        (elf, "section table"),
        (Path(sys.executable).resolve(), "no .go.buildinfo section"),
    ):
        with pytest.raises(ValueError, match=why):
            release.buildinfo(str(path))
    with pytest.raises(FileNotFoundError):
        release.buildinfo(str(tmp_path / "missing"))


def test_a_process_of_the_name_whose_binary_names_no_release_makes_it_unknown(tmp_path: Path) -> None:
    """Anyone can name a process `kubelet`: one whose binary names no release (here `sleep` under the
    name) makes the release unknown, judged by the newest rules, whatever else runs under the name.
    (The fixture's own release, read from its running binary: tests/e2e/test_real_kubelet.py.)"""
    name = f"hgrel{os.getpid() % 100000}"
    sleeper = tmp_path / name
    sleeper.symlink_to(shutil.which("sleep") or "/bin/sleep")
    proc = subprocess.Popen([str(sleeper), "30"])
    try:
        # Named so once it has exec'd: a loaded machine can be a moment later than the Popen.
        comm = Path(f"/proc/{proc.pid}/comm")
        deadline = time.monotonic() + 10
        while comm.read_text().strip() != name[:15] and time.monotonic() < deadline:
            time.sleep(0.01)
        found = release.from_process({name})
    finally:
        proc.kill()
        proc.wait()
    assert isinstance(found, str), found
    assert f"/proc/{proc.pid}/exe" in found, found
    assert kubelet_rules(found).refuses_second_register
    assert kubelet_rules(found).version == ""
    assert release.from_process({f"{name}x"}) == "no kubelet process is visible"


def test_the_rules_follow_the_release() -> None:
    old = kubelet_rules(release.Release("v1.36.5", (1, 36), "test"))
    new = kubelet_rules(release.Release("v1.37.2", (1, 37), "test"))
    assert (old.refuses_second_register, new.refuses_second_register) == (False, True)
    assert (old.name, new.name) == ("1.30-1.36", "1.37")
