"""CPU of one look between rounds where the kubelet's connections cannot be read (a pod with neither the
host's network nor its pids): pod-resources `GetAllocatableResources` (sidecar.deviceplugin.podlook),
against the real kubelet's device manager (tests/realkubelet) holding one plugin of 8 devices.

Prints the CPU time per call (this whole process: grpcio's own threads work for each call too),
median and p90 over LOOKS calls, and the wall time. The calls are spaced 20 ms: the kubelet answers
RESOURCE_EXHAUSTED past its rate (a burst of 10, then 100 a second, all clients together). Run as root
from the repository root: `python -m bench.pod_look`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time

from sidecar.deviceplugin.probes import pod_resources_devices
from sidecar.rpc import GrpcRuntime
from testing.realkubelet import RealKubelet, RealPlugin

LOOKS = int(os.environ.get("LOOKS", "500"))


async def main() -> None:
    top = tempfile.mkdtemp(prefix="hg-bench-")
    dp_dir = os.path.join(top, "device-plugins")
    os.mkdir(dp_dir, 0o750)
    pod_resources = os.path.join(top, "pod-resources", "kubelet.sock")
    runtime = GrpcRuntime()
    runtime.hold()  # as the sidecar does for its life
    try:
        async with (
            RealKubelet(dp_dir, pod_resources) as _,
            RealPlugin(
                dp_dir, "huawei.com/Ascend910B3", "Ascend910B3.sock", devices=[f"NPU-{i}" for i in range(8)]
            ),
        ):
            for _ in range(50):  # registered, and the first channel's costs paid
                if (await pod_resources_devices(pod_resources, 1.0)).value:
                    break
                await asyncio.sleep(0.1)
            cpu, wall = [], []
            for _ in range(LOOKS):
                c, w = time.process_time(), time.perf_counter()
                reading = await pod_resources_devices(pod_resources, 1.0)
                cpu.append(time.process_time() - c)
                wall.append(time.perf_counter() - w)
                assert reading.value, reading.error
                await asyncio.sleep(0.02)  # the kubelet rate-limits pod-resources (a burst of 10, then 100/s)
    finally:
        runtime.release()
    cpu.sort()
    wall.sort()
    p90 = cpu[int(0.9 * len(cpu))]
    print(f"pod-resources look, {LOOKS} calls (python {sys.version.split()[0]}):")
    print(f"  CPU  median {statistics.median(cpu) * 1e3:.2f} ms, p90 {p90 * 1e3:.2f} ms")
    print(f"  wall median {statistics.median(wall) * 1e3:.2f} ms")
    print(f"  at 1 look a second: {statistics.median(cpu) * 100:.3f} % of a core")


if __name__ == "__main__":
    asyncio.run(main())
