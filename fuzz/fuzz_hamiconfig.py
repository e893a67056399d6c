"""Fuzz harness: HAMi's node configuration and the driver's GPU information files, parsed totally.

`parse_node_config` answers what HAMi's plugin takes from config.json (an unreadable file: no filter, and
why), `parse_gpu_information` what the driver's information file says; neither ever raises. Any
exception, or an answer of the wrong shape, is a finding (`make fuzz`; seeds in fuzz/corpus/hamiconfig/).
"""

from __future__ import annotations

from sidecar.deviceplugin.hamiconfig import NodeConfig, parse_node_config
from sidecar.deviceplugin.hostdevices import Gpu, parse_gpu_information

NODES = ("gpu-node-1", "", "your-node-name")


def TestOneInput(data: bytes) -> None:
    for node in NODES:
        cfg = parse_node_config(data, node)
        assert isinstance(cfg, NodeConfig)
        assert all(isinstance(u, str) for u in cfg.uuids)
        assert all(isinstance(i, int) and i >= 0 for i in cfg.indices)
        assert not (cfg.error and cfg.filters), "an unreadable file filters nothing"
    gpu = parse_gpu_information(data.decode("utf-8", errors="replace"), "0000:00:00.0")
    assert isinstance(gpu, Gpu)
    assert gpu.minor is None or gpu.minor >= 0
