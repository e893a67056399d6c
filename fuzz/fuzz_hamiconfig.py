"""Fuzz harness: HAMi's node configuration and the driver's GPU information files, parsed totally.

`TestOneInput(data)` is the entry point a coverage-guided fuzzer calls (atheris' convention); the seed
corpus is fuzz/corpus/hamiconfig/. Any exception, or an answer of the wrong shape, is a finding.
"""

from __future__ import annotations

import sys

from sidecar.hamiconfig import Gpu, NodeConfig, parse_gpu_information, parse_node_config

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


def main(paths: list[str]) -> int:
    """Run the harness once over each file given (the corpus, without a fuzzer)."""
    for path in paths:
        with open(path, "rb") as f:
            TestOneInput(f.read())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
