"""What each image holds, proven to run: no Docker engine here, so the test does what the
Dockerfile's build stage does (its COPY lines into a fresh folder, the wheel built there, that
wheel plus exactly the image's pinned requirements in a fresh virtual environment) and runs the
Dockerfile's ENTRYPOINT and every command the image ships from there."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testing import free_port
from tests.conftest import wait_ready
from tests.proctable import isolated
from tests.test_layers import imports, modules

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "/opt/hami-guard"


@dataclass(frozen=True)
class Image:
    name: str
    entrypoint: list[str]
    venv: Path
    requirements: Path
    commands: frozenset[str]  # the console scripts its wheel declares

    def here(self, argv: list[str]) -> list[str]:
        """An argv of the image, with its prefix where this test installed it."""
        return [a.replace(PREFIX, str(self.venv)) for a in argv]


def build_stage(dockerfile: str) -> tuple[list[list[str]], str]:
    """The build stage's COPY instructions (sources..., destination) and the wheel it installs."""
    text = (ROOT / dockerfile).read_text()
    stage = re.split(r"^FROM ", text, flags=re.MULTILINE)[1]  # the first FROM is the build stage
    copies = [
        line.split()[1:] for line in stage.splitlines() if line.startswith("COPY ") and "--from" not in line
    ]
    wheel = re.search(r"/wheels/(\S+\.whl)", stage).group(1)  # type: ignore[union-attr]
    return copies, wheel


def stage_sources(copies: list[list[str]], into: Path) -> None:
    """Each COPY as Docker does it, relative to the build's WORKDIR."""
    for *sources, dest in copies:
        for source in sources:
            src = ROOT / source
            target = into / dest / src.name if dest.endswith("/") else into / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, target)


def build_wheel(src: Path, out: Path, pattern: str) -> Path:
    """The wheel of the project in `src`, as the images' build stage makes it."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob(pattern)
    return wheel


def build_image(dockerfile: str, tmp: Path) -> Image:
    text = (ROOT / dockerfile).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    copies, wheel_glob = build_stage(dockerfile)
    src, wheels, venv = tmp / "src", tmp / "wheels", tmp / "opt-hami-guard"
    stage_sources(copies, src)
    wheel = build_wheel(src, wheels, wheel_glob)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--no-deps", "-r", "requirements.txt", str(wheel)],
        cwd=src,
        check=True,
        capture_output=True,
    )
    dist = wheel.name.split("-")[0]
    listed = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m, sys\n"
            "print(' '.join(e.name for e in m.distribution(sys.argv[1]).entry_points "
            "if e.group == 'console_scripts'))",
            dist,
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp,
    ).stdout
    return Image(dockerfile, entry, venv, src / "requirements.txt", frozenset(listed.split()))


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Image]:
    built: dict[str, Image] = {}

    def get(dockerfile: str) -> Image:
        if dockerfile not in built:
            built[dockerfile] = build_image(dockerfile, tmp_path_factory.mktemp(dockerfile.lower()))
        return built[dockerfile]

    return get


@pytest.fixture
def listening(short_tmp: str) -> Iterator[str]:
    folder = os.path.join(short_tmp, "device-plugins")
    os.mkdir(folder)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(folder, "kubelet.sock"))
        s.listen()
        yield folder


@pytest.mark.parametrize(
    ("dockerfile", "commands"),
    [
        ("Dockerfile.init", {"hami-initcheck"}),
        ("Dockerfile.sidecar", {"hami-initcheck", "hami-sidecar", "hami-doctor"}),
    ],
)
def test_every_command_the_image_ships_starts(
    image: Callable[[str], Image], dockerfile: str, commands: set[str]
) -> None:
    """No broken console script ships: each script in the image's bin/ answers --help."""
    img = image(dockerfile)
    assert img.commands == commands
    scripts = []
    for path in sorted((img.venv / "bin").iterdir()):
        if path.name.startswith("activate") or not os.access(path, os.X_OK) or path.is_symlink():
            continue
        with path.open("rb") as f:
            if f.readline().startswith(b"#!"):
                scripts.append(path)
    assert {p.name for p in scripts} >= commands
    for script in scripts:
        done = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=img.venv)
        assert done.returncode == 0, f"{script.name} --help: {done.stderr[-2000:]}"


def test_init_image_runs_initcheck_with_what_it_imports_only(
    image: Callable[[str], Image], listening: str, short_tmp: str
) -> None:
    img = image("Dockerfile.init")
    installed = subprocess.run(
        [
            str(img.venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m\nprint(' '.join(d.metadata['Name'] for d in m.distributions()))",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=img.venv,
    ).stdout.split()
    # The venv's own installers, the wheel, and exactly the pinned requirements (none at all today).
    assert {_dist(n) for n in installed} - {"pip", "setuptools"} == {"hami-guard-initcheck"} | _requirements(
        img.requirements
    )
    argv = img.here(img.entrypoint)
    # With a process table of the test's own (tests/proctable.py): no other kubelet on the machine.
    own = isolated([*argv, "--device-plugin-dir", listening], os.path.join(short_tmp, "table"))
    ok = subprocess.run(own, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("ok: ")
    failing = subprocess.run([*argv, "--device-plugin-dir", "/nonexistent"], capture_output=True)
    assert failing.returncode == 100
    for module in ("grpc", "aiohttp", "watchdog", "psutil", "sidecar", "doctor"):
        probe = subprocess.run(
            [str(img.venv / "bin" / "python"), "-c", f"import {module}"], cwd=img.venv, capture_output=True
        )
        assert probe.returncode != 0, f"{module} is in the init image"


# What only the tests, the demo and the node end-to-end run: the simulator, the real-kubelet and DRA
# drivers, the network namespaces, the stand-in. None of it may reach an image or the product wheel.
RIG_MARKERS = (b"class FakeKubelet", b"class FakeDevicePlugin", b"class RealKubelet", b"class Netns")


def _is_rig(path: Path) -> bool:
    """A `testing` package, or a module that defines one of the rig's classes."""
    if path.is_dir():
        return path.name == "testing" and (path / "__init__.py").exists()
    return path.suffix == ".py" and any(m in path.read_bytes() for m in RIG_MARKERS)


def _rig_files(tree: Path) -> list[str]:
    return [str(path.relative_to(tree)) for path in tree.rglob("*") if _is_rig(path)]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.init", "Dockerfile.sidecar"])
def test_the_images_hold_no_test_rig(image: Callable[[str], Image], dockerfile: str) -> None:
    img = image(dockerfile)
    (site,) = img.venv.glob("lib/python3*/site-packages")
    assert (site / "initcheck" / "cli.py").exists()  # the scan looks where the product is
    assert _rig_files(site) == []
    probe = subprocess.run([str(img.venv / "bin" / "python"), "-c", "import testing"], cwd=img.venv)
    assert probe.returncode != 0


PRODUCT_PACKAGES = {"hami_guard", "initcheck", "sidecar", "doctor"}


def test_the_product_wheel_holds_no_test_rig(tmp_path: Path) -> None:
    """The wheel built from the repository's pyproject.toml, with every top-level package of the checkout
    beside it (the rig, the tests, the benchmarks too): the three programs only."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ROOT.iterdir():
        if (package / "__init__.py").exists():
            shutil.copytree(
                package, src / package.name, ignore=shutil.ignore_patterns("__pycache__", "bin", "*.tar")
            )
    assert (src / "testing").is_dir()
    wheel = build_wheel(src, tmp_path, "hami_guard-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        assert top == PRODUCT_PACKAGES
        assert [n for n in names if n.endswith(".py") and any(m in z.read(n) for m in RIG_MARKERS)] == []
        # The data the programs read at import: the vendor profiles, their log patterns, the catalogue.
        data = {str(f.relative_to(ROOT)) for f in (ROOT / "hami_guard" / "profiles").rglob("*.toml")}
        assert data | {"doctor/patterns.toml"} <= set(names)


def test_sidecar_image_serves(image: Callable[[str], Image], listening: str) -> None:
    img = image("Dockerfile.sidecar")
    port = free_port()
    proc = subprocess.Popen(
        [*img.here(img.entrypoint), "--device-plugin-dir", listening, "--listen", f"127.0.0.1:{port}"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=15)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            assert b"device_plugin_check_up" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        proc.kill()


def test_the_init_wheel_is_the_projects_initcheck() -> None:
    """images/init/pyproject.toml builds part of the project: same version, dependencies, command."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    init = tomllib.loads((ROOT / "images" / "init" / "pyproject.toml").read_text())["project"]
    assert init["version"] == project["version"]
    assert init["requires-python"] == project["requires-python"]
    assert set(init["dependencies"]) <= set(project["dependencies"])  # the same ranges as the sidecar's
    assert init["scripts"] == {"hami-initcheck": project["scripts"]["hami-initcheck"]}


def _dist(requirement: str) -> str:
    """A requirement's (or a distribution's) name, normalised as PyPI does."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]).lower()


def _requirements(path: Path) -> set[str]:
    """The distributions a requirements file pins."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {_dist(line) for line in lines if line}


def imported_from(root: Path, entry: str, packages: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """What `entry` imports when it runs, read with `ast` (tests/test_layers.py): the packages neither the
    standard library nor `packages` (third-party: they must be installed), and the first-party modules
    it loads (every import that runs, inside functions too; not those for annotations only), with the
    packages they are in."""
    known = modules(root, packages)
    seen: set[str] = set()
    third: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # its packages' __init__ run first
        for e in imports(name, known[name], known):
            top = e.imported.split(".")[0]
            if e.type_only or top == "__future__" or top in sys.stdlib_module_names:
                continue
            if top in packages:
                todo.append(e.imported)
            else:
                third.add(top)
    return third, seen


def test_the_init_image_requires_exactly_what_initcheck_imports() -> None:
    """The init image's pinned requirements and its wheel's dependencies name the distributions of the
    third-party packages hami-initcheck imports, no more and no fewer: a dependency added back that
    nothing imports is a package on every node for nothing, one missing a failed plugin start. And the
    init wheel holds every module of the project that initcheck loads."""
    init = tomllib.loads((ROOT / "images" / "init" / "pyproject.toml").read_text())
    entry = init["project"]["scripts"]["hami-initcheck"].split(":")[0]
    third, loaded = imported_from(ROOT, entry, ("hami_guard", "initcheck"))
    owners = importlib.metadata.packages_distributions()
    needed = {_dist(d) for top in third for d in owners.get(top, [top])}
    copies, _ = build_stage("Dockerfile.init")
    (requirements,) = (ROOT / s for *sources, dest in copies for s in sources if dest == "./requirements.txt")
    assert _requirements(requirements) == needed
    assert {_dist(d) for d in init["project"]["dependencies"]} == needed
    wheel = set(init["tool"]["setuptools"]["packages"])
    assert {m.rpartition(".")[0] if m not in wheel else m for m in loaded} <= wheel


def test_the_import_reading_finds_what_runs(tmp_path: Path) -> None:
    """The reading above on a small tree: an import inside a function runs, one for annotations does
    not, a parent package's __init__ runs, and the standard library needs no installing."""
    files = {
        "app/__init__.py": "import yaml\n",
        "app/cli.py": "import json\nfrom app import core\n",
        "app/core.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import numpy\n\n"
            "def f():\n    import psutil\n"
        ),
        "app/unused.py": "import grpc\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    third, loaded = imported_from(tmp_path, "app.cli", ("app",))
    assert third == {"yaml", "psutil"}
    assert loaded == {"app", "app.cli", "app.core"}


def test_npd_runs_hami_doctor_through_the_configs_command_line(
    image: Callable[[str], Image], short_tmp: str
) -> None:
    """The rule of manifests/npd/hami-guard-monitor.json, as NPD's custom plugin runs it: its path and
    arguments from the sidecar image's /opt/hami-guard (Dockerfile.npd copies that folder, and the Python
    it links to, into NPD's image), nothing else on PATH, with an empty device-plugins folder for the
    kubelet's. NPD reads exit 0 as OK, 1 as NonOK, anything else as Unknown, and keeps
    max_output_length characters of stdout: a missing kubelet is one NonOK line that fits."""
    config = json.loads((ROOT / "manifests" / "npd" / "hami-guard-monitor.json").read_text())
    (rule,) = config["rules"]
    img = image("Dockerfile.sidecar")
    assert rule["path"] == f"{PREFIX}/bin/hami-doctor"
    empty = os.path.join(short_tmp, "device-plugins")
    os.mkdir(empty)
    argv = img.here([rule["path"], *rule["args"], "--device-plugin-dir", empty])
    timeout = float(rule["timeout"].rstrip("s"))
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={"PATH": "/nonexistent"}, cwd=short_tmp
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stdout.splitlines()
    assert "SOCKET_MISSING" in line  # the finding, not a usage or start-up error
    assert len(line) <= config["pluginConfig"]["max_output_length"]
    # The rule's --host-dev is where manifests/npd/daemonset mounts the host's /dev.
    patch = (ROOT / "manifests" / "npd" / "daemonset" / "patch.yaml").read_text()
    host_dev = rule["args"][rule["args"].index("--host-dev") + 1]
    assert f"mountPath: {host_dev}\n" in patch
