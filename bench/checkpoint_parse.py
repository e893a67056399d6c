"""The worst checkpoints the reader accepts, and the one that motivated its bounds: parse time and the
peak RSS it adds, each in a fresh process (ru_maxrss only grows). Goal: within the bounds of
sidecar/deviceplugin/checkpoint.py, well under 50 ms and a few MiB; over them, refused at no cost.

`python -m bench.checkpoint_parse`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from sidecar.deviceplugin.checkpoint import (
    MAX_CHECKPOINT_BYTES,
    MAX_CHECKPOINT_VALUES,
    CheckpointError,
    read_checkpoint,
)

ROUNDS = int(os.environ.get("ROUNDS", "5"))
COMPACT = (",", ":")


def _doc(registered: object, entries: object = ()) -> bytes:
    data = {"PodDeviceEntries": list(entries), "RegisteredDevices": registered}  # type: ignore[call-overload]
    return json.dumps({"Data": data, "Checksum": 1}, separators=COMPACT).encode()


def cases() -> dict[str, bytes]:
    n = MAX_CHECKPOINT_VALUES - 16
    long_id = "GPU-" + "0" * (MAX_CHECKPOINT_BYTES // n - 10)
    realistic_ids = [f"GPU-{i:08x}-0000-0000-0000-000000000000-{s}" for i in range(256) for s in range(100)]
    alloc = "A" * 4096
    entries = [
        {
            "PodUID": f"{i:036d}",
            "ContainerName": "cuda",
            "ResourceName": "nvidia.com/gpu",
            "DeviceIDs": {"0": realistic_ids[i * 25 : (i + 1) * 25]},
            "AllocResp": alloc,
        }
        for i in range(1024)
    ]
    return {
        "largest realistic node (256 GPUs x 100, 1,024 entries)": _doc(
            {"nvidia.com/gpu": realistic_ids}, entries
        ),
        "values at the bound, empty keys": _doc({f"r{i}": [] for i in range(n // 2)}),
        "values at the bound, tiny ints": _doc({"r": [0] * n}),
        "values and bytes at the bound (long IDs)": _doc({"r": [long_id] * n}),
        "over the bound: 1e6 empty keys": _doc({f"r{i}": [] for i in range(1_000_000)}),
    }


def measure(path: str, unbounded: bool) -> None:
    """In the child: one read, its time and the peak RSS it added."""
    before = _peak_kib()
    start, cpu = time.perf_counter(), time.process_time()
    if unbounded:  # what the reader did before its bounds: one json.loads, whatever the size
        with open(path, "rb") as f:
            json.loads(f.read())
        outcome = "parsed"
    else:
        try:
            found = read_checkpoint(path)
            outcome = f"read, {sum(len(ids) for ids in found.registered.values())} IDs"
        except CheckpointError as e:
            outcome = f"refused: {e}"
    took, used = time.perf_counter() - start, time.process_time() - cpu
    grew = (_peak_kib() - before) / 1024
    print(json.dumps({"ms": took * 1000, "cpu_ms": used * 1000, "rss_mib": grew, "outcome": outcome}))


def _peak_kib() -> int:
    """VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over from the fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    print(f"bounds: {MAX_CHECKPOINT_BYTES} bytes, {MAX_CHECKPOINT_VALUES} values; best of {ROUNDS} processes")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kubelet_internal_checkpoint")
        for name, raw in cases().items():
            with open(path, "wb") as f:
                f.write(raw)
            for unbounded in (False, True):
                runs = [
                    json.loads(
                        subprocess.run(
                            [sys.executable, "-m", "bench.checkpoint_parse", "--child", path, str(unbounded)],
                            capture_output=True,
                            check=True,
                            text=True,
                            timeout=120,
                        ).stdout
                    )
                    for _ in range(ROUNDS)
                ]
                best = min(runs, key=lambda r: r["ms"])
                how = "json.loads alone" if unbounded else "read_checkpoint "
                print(
                    f"{name} ({len(raw) / 2**20:.1f} MiB), {how}: {best['ms']:.1f} ms "
                    f"({best['cpu_ms']:.1f} CPU), "
                    f"+{max(r['rss_mib'] for r in runs):.1f} MiB RSS; {best['outcome'][:70]}"
                )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        measure(sys.argv[2], sys.argv[3] == "True")
    else:
        main()
