"""HAMi's vendors' plugins side by side on one node whose kubelet is the real device manager.

Each plugin is the fixture's (tests/realkubelet), shaped as the vendor's plugin registers, from each
plugin's code, with the device IDs the stand-in gives each vendor (testing/vendorids.py): NVIDIA's (HAMi
in-tree: `nvidia.com/gpu` on `nvidia-gpu.sock`, IDs `<GPU-UUID>-<n>`), Ascend's
(Project-HAMi/ascend-device-plugin: `huawei.com/<CommonWord>` on `<CommonWord>.sock`, IDs
`<VDie ID>-<i>`), kubevirt device-plugin-manager plugins' (no `.sock`: AMD's, `amd.com/gpu` on
`amd.com_gpu`, IDs `<PCI address>#<n>`; Hygon DCU's, `hygon.com/dcunum` on `hygon.com_dcunum`, IDs
`DCU-<serial>-fake-<i>`; Biren's, `birentech.com/gpu` on `birentech.com_gpu`, `card_<N>` once each) and
a capacity-only one's (Cambricon's default mode: `cambricon.com/mlu` on `cambricon.sock`; HAMi reads the
Node's capacity, no annotation). The sidecar judges each by the same rules, its IDs folded by its own
profile: every one registered with its physical devices counted, and a drop of one fails that one.
"""

from __future__ import annotations

from sidecar.config import PluginSpec
from testing import vendorids
from testing.realkubelet import Release
from tests.e2e.realnode import real_node


def ids(vendor: str, resource: str, devices: int, split: int) -> list[str]:
    """`devices` of the vendor's, each listed `split` times, as its plugin lists them to the kubelet."""
    return [i for card in vendorids.form(vendor).cards(devices, split, resource) for i in card.shares]


# (resource, socket, device IDs, physical devices the sidecar counts)
PLUGINS = (
    ("nvidia.com/gpu", "nvidia-gpu.sock", ids("nvidia", "nvidia.com/gpu", 2, 2), 2),
    ("huawei.com/Ascend910B3", "Ascend910B3.sock", ids("ascend", "huawei.com/Ascend910B3", 1, 4), 1),
    ("amd.com/gpu", "amd.com_gpu", ids("amd", "amd.com/gpu", 1, 3), 1),
    ("hygon.com/dcunum", "hygon.com_dcunum", ids("dcu", "hygon.com/dcunum", 2, 4), 2),
    ("birentech.com/gpu", "birentech.com_gpu", ids("biren", "birentech.com/gpu", 3, 1), 3),
    ("cambricon.com/mlu", "cambricon.sock", ["MLU-20240001", "MLU-20240002"], 2),
)


async def test_every_vendors_plugin_registers_and_a_drop_fails_that_one_alone(
    release: Release, dp_dir: str, short_tmp: str
) -> None:
    specs = tuple(PluginSpec(r, s) for r, s, _, _ in PLUGINS)
    async with real_node(dp_dir, short_tmp, release, plugins=specs) as node:
        for resource, socket, devices, _ in PLUGINS:
            await node.plugin(resource, socket, devices)
        await node.until("/readyz", 200)
        body = (await node.get("/readyz?verbose"))[1]
        for resource, _, _, _ in PLUGINS:
            for kind in ("plugin", "registered", "kubelet-client", "devices"):
                assert f"[+]{kind}:{resource} ok" in body, body
        counts = node.sidecar.judge.devices()
        # Each vendor's shares folded by its own profile: its physical devices.
        assert {r: counts[r]["pod_resources"] for r, _, _, _ in PLUGINS} == {r: n for r, _, _, n in PLUGINS}
        amd = next(p for p in node.plugins if p.resource == "amd.com/gpu")
        await amd.end_stream("oldest")  # the kubelet drops the dpm-shaped plugin
        await node.until("/healthz?verbose", 503, contains="[-]registered:amd.com/gpu failed")
        _, body = await node.get("/healthz?verbose")
        assert "dropped the plugin" in body, body
        for resource, _, _, _ in PLUGINS:
            if resource != "amd.com/gpu":
                assert f"[+]registered:{resource} ok" in body, body
