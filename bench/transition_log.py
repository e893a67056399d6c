"""The sidecar's log while its plugin's socket is swapped every 2 ms: bytes a minute, and by which lines.

The real sidecar (`--log-format json`, its own process) beside the simulated kubelet and plugin; for
SECONDS (15) the plugin's socket file is replaced every 2 ms by a listener of this script's (a bare
socket: each swap moves the plugin's checks), then the log's growth is printed, as bytes a minute, and
its most frequent messages. Run it from another checkout's folder to measure that checkout's sidecar
(`python -m` runs the sidecar from the working folder).

    .venv/bin/python -m bench.transition_log      # SECONDS=15
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import socket
import tempfile
import time

from bench.common import node

SECONDS = float(os.environ.get("SECONDS", "15"))
EVERY = 0.002


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hg-tlog-") as folder:
        log = os.path.join(folder, "sidecar.log")
        async with node("--log-format", "json", log=log) as n:
            await asyncio.sleep(1.0)
            start_size = os.path.getsize(log)
            path = os.path.join(n.dir, "nvidia-gpu.sock")
            held: list[socket.socket] = []
            swaps, t0 = 0, time.monotonic()
            try:
                while time.monotonic() - t0 < SECONDS:
                    tmp = os.path.join(n.dir, f".swap{swaps % 2}")
                    s = socket.socket(socket.AF_UNIX)
                    s.bind(tmp)
                    s.listen(1)
                    os.rename(tmp, path)
                    held.append(s)
                    if len(held) > 2:
                        held.pop(0).close()
                    swaps += 1
                    await asyncio.sleep(EVERY)
                elapsed = time.monotonic() - t0
                await asyncio.sleep(1.0)
                grown = os.path.getsize(log) - start_size
            finally:
                for s in held:
                    s.close()
        messages: collections.Counter[str] = collections.Counter()
        with open(log, errors="replace") as f:
            f.seek(start_size)
            for line in f:
                try:
                    msg = str(json.loads(line).get("msg", ""))
                except ValueError:
                    msg = line
                messages[re.sub(r"\d+", "N", msg)[:70]] += 1  # one kind of line, whatever its counts
    print(
        f"{swaps} swaps in {elapsed:.1f} s (every {EVERY * 1000:g} ms): the log grew {grown / 1024:.0f} KiB, "
        f"{grown / elapsed * 60 / 1024:.0f} KiB a minute"
    )
    for msg, count in messages.most_common(6):
        print(f"  {count:6d}  {msg[:100]}")


if __name__ == "__main__":
    asyncio.run(main())
