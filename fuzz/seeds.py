"""Writes the seed corpora of fuzz/fuzz_logscan.py and fuzz/fuzz_checkpoint.py (fuzz/corpus/<name>/).

    python -m fuzz.seeds logscan      # the doctor's catalogue of real log lines (tests/test_doctor.py)
    python -m fuzz.seeds checkpoint   # checkpoints the kubelet's own device manager writes
                                      # (tests/realkubelet: `make kubelet-fixtures`; root, as its tests)

Kept small: each seed is one real shape, not a variation the fuzzer finds by itself.
"""

from __future__ import annotations

import asyncio
import calendar
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sidecar.deviceplugin.checkpoint import CHECKPOINT_NAME
from testing.realkubelet import RealKubelet, RealPlugin, missing_reason
from tests.test_doctor import CATALOG, REQUEST, cri, klog

CORPUS = Path(__file__).resolve().parent / "corpus"
# The log seeds' clock: fuzz_logscan.py scans them at NOW (half an hour later).
T = calendar.timegm((2026, 12, 3, 6, 0, 0, 0, 0, 0))


def _write(name: str, seed: str, data: bytes) -> None:
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / seed).write_bytes(data)


def _klog_at(line: str, at: float) -> str:
    """The catalogue's line with its klog header (and CRI prefix) moved to `at`."""
    t, u = time.localtime(at), time.gmtime(at)
    klog = f"{t.tm_mon:02d}{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"
    line = re.sub(r"^([IWEF])\d{4} \d{2}:\d{2}:\d{2}", rf"\g<1>{klog}", line)
    cri = time.strftime("%Y-%m-%dT%H:%M:%S", u)
    return re.sub(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+Z [a-z]+ F )([IWEF])\d{4} \d{2}:\d{2}:\d{2}",
                  rf"{cri}\g<1>\g<2>{klog}", line)  # fmt: skip


def logscan() -> None:

    # The seeds written here only: an input a fuzz run found (crash-*, fixed since) stays a regression test.
    for old in (CORPUS / "logscan").glob("*"):
        if not old.name.startswith("crash-"):
            old.unlink()
    for i, (line, _, _) in enumerate(CATALOG.values()):
        _write("logscan", f"catalog-{i:02d}", _klog_at(line, T).encode())
    request = klog("I", REQUEST, at=T, file="server.go:146")
    ended = _klog_at(CATALOG["ListAndWatch ended unexpectedly for device plugin"][0], T - 60)
    rejected = _klog_at(CATALOG["Bad registration request from device plugin"][0], T)
    _write("logscan", "kubelet-history", (ended + request + rejected + request).encode())
    _write("logscan", "kubelet-old-then-new", (_klog_at(ended, T - 7200) * 3 + request).encode())
    _write(
        "logscan",
        "kubelet-resource-not-utf8",
        request.replace("gpu", "gp\udcff").encode(errors="surrogateescape"),
    )
    register = cri(klog("I", "Could not register device ", at=T, pid=1, file="server.go:325"), at=T)
    split = (
        register.rstrip("\n").replace(" F ", " P ", 1)
        + "\n"
        + cri("plugin: context deadline exceeded\n", at=T)
    )
    registered = cri(
        klog("I", "Registered device plugin for 'nvidia.com/gpu' with Kubelet", at=T, pid=1), at=T
    )
    _write("logscan", "cri-partial", (split + registered).encode())
    _write("logscan", "journal", b"2026-12-03T06:00:00+0000 node kubelet[812]: " + request.encode())
    _write("logscan", "empty", b"")


async def _checkpoints(tmp: str) -> None:

    folder = os.path.join(tmp, "device-plugins")
    os.mkdir(folder, 0o750)
    path = os.path.join(folder, CHECKPOINT_NAME)

    def keep(seed: str) -> None:
        _write("checkpoint", seed, Path(path).read_bytes())

    for release in ("new", "old"):
        if missing_reason(release):
            print(f"skipped: {missing_reason(release)}", file=sys.stderr)
            continue
        async with RealKubelet(folder, release=release) as k:
            gpu = RealPlugin(folder, devices=("GPU-0@0", "GPU-1@0,1", "GPU-2"), release=release)
            npu = RealPlugin(folder, "huawei.com/Ascend910B3", "ascend.sock", ("NPU-0",), release=release)
            try:
                mark = k.mark()
                await gpu.start()
                await k.wait_checkpoint(after=mark)
                keep(f"{release}-registered")
                mark = k.mark()
                await k.allocate("pod-1", "cuda", "nvidia.com/gpu", 2)
                await k.wait_checkpoint(after=mark)
                keep(f"{release}-allocated")
                mark = k.mark()
                await npu.start()
                await k.wait_checkpoint(after=mark)
                keep(f"{release}-two-resources")
                mark = k.mark()
                await gpu.set_health("GPU-2", False)
                await k.wait_checkpoint(after=mark)
                keep(f"{release}-one-unhealthy")
                await gpu.crash()
                mark = k.mark()
                await npu.set_devices(["NPU-0", "NPU-1"])
                await k.wait_checkpoint(after=mark)
                keep(f"{release}-stream-ended")  # the ended resource is written with an empty list
            finally:
                await gpu.close()
                await npu.close()
        os.unlink(path)


def checkpoint() -> None:
    shutil.rmtree(CORPUS / "checkpoint", ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="hg-seeds-")
    try:
        asyncio.run(_checkpoints(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    for which in sys.argv[1:] or ["logscan", "checkpoint"]:
        {"logscan": logscan, "checkpoint": checkpoint}[which]()
