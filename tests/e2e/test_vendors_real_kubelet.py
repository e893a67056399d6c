"""HAMi's vendors' plugins side by side on one node whose kubelet is the real device manager.

Each plugin is the fixture's (tests/realkubelet), shaped as the vendor's plugin registers, from each
plugin's code: NVIDIA's (HAMi in-tree: `nvidia.com/gpu` on `nvidia-gpu.sock`, IDs `<GPU-UUID>-<n>`),
Ascend's (Project-HAMi/ascend-device-plugin: `huawei.com/<CommonWord>` on `<CommonWord>.sock`, IDs
`<NPU UUID>-<i>`), a kubevirt device-plugin-manager plugin's (AMD's, Project-HAMi/amd-device-plugin:
`amd.com/gpu` on `amd.com_gpu`, no `.sock`, IDs `<PCI id>#<n>`) and a capacity-only one's (Cambricon's
default mode: `cambricon.com/mlu` on `cambricon.sock`; HAMi reads the Node's capacity, no annotation).
The sidecar judges each by the same rules: every one registered, and a drop of one fails that one.
"""

from __future__ import annotations

from sidecar.config import PluginSpec
from testing.realkubelet import Release
from tests.e2e.realnode import UUIDS, real_node

ASCEND_UUID = "a3c9f1d2-6b7e-4c8a-9d0f-1e2b3c4d5e6f"
PLUGINS = (
    ("nvidia.com/gpu", "nvidia-gpu.sock", [f"{u}-{n}" for u in UUIDS for n in range(2)]),
    ("huawei.com/Ascend910B3", "Ascend910B3.sock", [f"{ASCEND_UUID}-{i}" for i in range(4)]),
    ("amd.com/gpu", "amd.com_gpu", [f"0000:c1:00.0#{n}" for n in range(3)]),
    ("cambricon.com/mlu", "cambricon.sock", ["MLU-20240001", "MLU-20240002"]),
)


async def test_every_vendors_plugin_registers_and_a_drop_fails_that_one_alone(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    specs = tuple(PluginSpec(r, s) for r, s, _ in PLUGINS)
    async with real_node(dp_dir, short_tmp, release, plugins=specs) as node:
        for resource, socket, devices in PLUGINS:
            await node.plugin(resource, socket, devices)
        await node.until("/readyz", 200)
        body = (await node.get("/readyz?verbose"))[1]
        for resource, _, _ in PLUGINS:
            for kind in ("plugin", "registered", "kubelet-client", "devices"):
                assert f"[+]{kind}:{resource} ok" in body, body
        counts = node.sidecar.judge.devices()
        assert counts["huawei.com/Ascend910B3"]["pod_resources"] == 1  # <NPU UUID>-<i>: one NPU's vNPUs
        assert counts["cambricon.com/mlu"]["pod_resources"] == 2
        assert counts["amd.com/gpu"]["pod_resources"] == 1  # <bus>#<n>: one GPU, AMD's profile folds
        assert counts["nvidia.com/gpu"]["pod_resources"] == 2  # <GPU-UUID>-<n>: two GPUs
        amd = next(p for p in node.plugins if p.resource == "amd.com/gpu")
        await amd.end_stream("oldest")  # the kubelet drops the dpm-shaped plugin
        await node.until("/healthz?verbose", 503, contains="[-]registered:amd.com/gpu failed")
        _, body = await node.get("/healthz?verbose")
        assert "dropped the plugin" in body, body
        for resource, _, _ in PLUGINS:
            if resource != "amd.com/gpu":
                assert f"[+]registered:{resource} ok" in body, body
