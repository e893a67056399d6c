"""HAMi's node configuration as HAMi's plugin reads it, and auto's expectation from real files in a folder.

The configuration files are in HAMi's real format: the chart's device-plugin ConfigMap `config.json`
(charts/hami/values.yaml, devicePlugin.nodeConfiguration.config), `nodeconfig` entries by node name with
`filterdevices: {uuid: [...], index: [...]}`. The driver's information files follow
/proc/driver/nvidia/gpus/<bus>/information.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from fuzz.fuzz_hamiconfig import TestOneInput
from hami_guard import profiles
from sidecar.deviceplugin.hamiconfig import Sources, expectation, parse_node_config
from sidecar.deviceplugin.hostdevices import parse_gpu_information, read_gpus

NODE = "gpu-node-1"
UUIDS = (
    "GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f",
    "GPU-7c9b6d1f-3a1f-5e5d-ad5c-1b2c3d4e5f60",
    "GPU-8dac7e20-4b20-6f6e-be6d-2c3d4e5f6071",
    "GPU-9ebd8f31-5c31-7a7f-cf7e-3d4e5f607182",
)
BUSES = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")


def chart_config(*entries: dict[str, object]) -> bytes:
    """config.json as the chart writes it: the values.yaml example's keys, one entry per node."""
    base: dict[str, object] = {
        "name": "your-node-name",
        "operatingmode": "hami-core",
        "devicememoryscaling": 1,
        "devicesplitcount": 10,
        "preconfigureddevicememory": 0,
        "enablenumatopology": False,
        "migstrategy": "none",
        "filterdevices": {"uuid": [], "index": []},
        "enablegetpreferredallocation": False,
    }
    return json.dumps({"nodeconfig": [{**base, **e} for e in entries]}, indent=2).encode()


def information(uuid: str, bus: str, minor: int, excluded: str = "No") -> str:
    """The NVIDIA driver's /proc/driver/nvidia/gpus/<bus>/information."""
    return (
        "Model: \t\t NVIDIA A100-SXM4-40GB\n"
        "IRQ:   \t\t 150\n"
        f"GPU UUID: \t {uuid}\n"
        "Video BIOS: \t 92.00.45.00.03\n"
        "Bus Type: \t PCIe\n"
        "DMA Size: \t 47 bits\n"
        "DMA Mask: \t 0x7fffffffffff\n"
        f"Bus Location: \t {bus}\n"
        f"Device Minor: \t {minor}\n"
        f"GPU Excluded:\t {excluded}\n"
    )


class Host:
    """A node's /dev, /proc/driver/nvidia/gpus, vfio-pci folder and HAMi's mounted config.json."""

    def __init__(self, root: str, gpus: int = 4) -> None:
        self.root = root
        self.dev = os.path.join(root, "dev")
        self.gpus = os.path.join(root, "proc-gpus")
        self.vfio = os.path.join(root, "vfio-pci")
        self.config = os.path.join(root, "config", "config.json")
        for d in (self.dev, self.gpus, self.vfio, os.path.dirname(self.config)):
            os.makedirs(d)
        Path(self.dev, "nvidiactl").touch()
        for i in range(gpus):
            self.add_gpu(i)

    def add_gpu(self, i: int, minor: int | None = None) -> None:
        minor = i if minor is None else minor
        Path(self.dev, f"nvidia{minor}").touch()
        os.makedirs(os.path.join(self.gpus, BUSES[i]))
        Path(self.gpus, BUSES[i], "information").write_text(information(UUIDS[i], BUSES[i], minor))

    def sources(self, node: str = NODE) -> Sources:
        return Sources(os.path.join(self.dev, "nvidia[0-9]*"), self.config, node, self.gpus, self.vfio)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(str(tmp_path))


# -- the node configuration, as HAMi decodes it --------------------------------------------------


def test_the_entry_named_after_the_node_sets_the_filter() -> None:
    data = chart_config(
        {"name": "other-node", "filterdevices": {"uuid": [UUIDS[0]], "index": [0]}},
        {"name": NODE, "filterdevices": {"uuid": [UUIDS[1]], "index": [3]}},
    )
    cfg = parse_node_config(data, NODE)
    assert (cfg.entries, cfg.uuids, cfg.indices, cfg.error) == (1, (UUIDS[1],), (3,), "")
    assert not parse_node_config(data, "gpu-node-2").filters


def test_the_last_entry_with_a_filter_wins_and_an_empty_one_keeps_it() -> None:
    """HAMi applies every entry for the node in turn, replacing the filter only with a non-empty one."""
    data = chart_config(
        {"name": NODE, "filterdevices": {"uuid": [UUIDS[0]]}},
        {"name": NODE, "filterdevices": {"index": [2]}},
        {"name": NODE, "filterdevices": {"uuid": [], "index": []}},
    )
    cfg = parse_node_config(data, NODE)
    assert (cfg.entries, cfg.uuids, cfg.indices) == (3, (), (2,))


def test_keys_match_as_go_matches_them_case_insensitively_the_later_duplicate_winning() -> None:
    data = (
        b'{"NodeConfig": [{"NAME": "%s", "FilterDevices": {"Index": [1], "index": [2]}, "unknown": {}}]}'
        % NODE.encode()
    )
    assert parse_node_config(data, NODE).indices == (2,)


@pytest.mark.parametrize(
    "data",
    [
        b'{"nodeconfig": [{"name": "gpu-node-1", "filterdevices": {"index": [-1]}}]}',
        b'{"nodeconfig": [{"name": "gpu-node-1", "filterdevices": {"index": [1.0]}}]}',
        b'{"nodeconfig": [{"name": "gpu-node-1", "filterdevices": {"index": ["1"]}}]}',
        b'{"nodeconfig": [{"name": "gpu-node-1", "filterdevices": {"uuid": "GPU-1"}}]}',
        b'{"nodeconfig": [{"name": 7, "filterdevices": {"index": [1]}}]}',
        b'{"nodeconfig": [{"name": "gpu-node-1", "devicesplitcount": -1, "filterdevices": {"index": [1]}}]}',
        b'{"nodeconfig": {"name": "gpu-node-1"}}',
        b'["nodeconfig"]',
        b'{"nodeconfig": [{"name": "gpu-node-1", "filterdevices": {"index": [NaN]}}]}',
        b'{"nodeconfig": [',
        b"",
    ],
)
def test_a_file_hamis_decoder_refuses_filters_nothing_and_says_why(data: bytes) -> None:
    """HAMi logs the decode error and applies no filter at all: auto then subtracts nothing."""
    cfg = parse_node_config(data, NODE)
    assert not cfg.filters
    assert cfg.error.endswith("so it filters nothing")


def test_null_and_empty_documents_filter_nothing_without_an_error() -> None:
    for data in (b"null", b"{}", b'{"nodeconfig": null}', b'{"nodeconfig": [null]}'):
        cfg = parse_node_config(data, NODE)
        assert (cfg.filters, cfg.error) == (False, ""), data


def test_mig_is_named_by_the_operating_mode_or_the_strategy() -> None:
    assert parse_node_config(chart_config({"name": NODE, "operatingmode": "mig"}), NODE).mig
    assert parse_node_config(chart_config({"name": NODE, "migstrategy": "mixed"}), NODE).mig
    assert not parse_node_config(chart_config({"name": NODE}), NODE).mig


def test_the_drivers_information_file_gives_uuid_minor_and_bus() -> None:
    gpu = parse_gpu_information(information(UUIDS[2], BUSES[2], 5), "x")
    assert (gpu.uuid, gpu.minor, gpu.bus, gpu.excluded) == (UUIDS[2], 5, BUSES[2], False)
    broken = parse_gpu_information("GPU UUID: ../../etc\nDevice Minor: -3\n\x00", "0000:01:00.0")
    assert (broken.uuid, broken.minor, broken.bus) == ("", None, "0000:01:00.0")


# -- auto's expectation, from files -------------------------------------------------------------------


def test_two_filtered_gpus_of_four_are_subtracted_and_named(host: Host) -> None:
    Path(host.config).write_bytes(
        chart_config({"name": NODE, "filterdevices": {"uuid": [UUIDS[1]], "index": [3]}})
    )
    e = expectation(host.sources())
    assert (e.want, e.host) == (2, 4)
    assert [f.device for f in e.filtered] == [
        f"index 1, {UUIDS[1]}, {host.dev}/nvidia1",
        f"index 3, {UUIDS[3]}, {host.dev}/nvidia3",
    ]
    assert [f.why.split(" in ")[0] for f in e.filtered] == [
        "uuid listed",
        "index listed",
    ]
    assert f"filterdevices of nodeconfig {NODE}" in e.filtered[0].why
    assert e.expected == (
        f"index 0, {UUIDS[0]}, {host.dev}/nvidia0",
        f"index 2, {UUIDS[2]}, {host.dev}/nvidia2",
    )
    assert "2 filtered by HAMi's node configuration" in e.summary()


def test_the_index_is_the_pci_bus_order_not_the_device_minor(tmp_path: Path) -> None:
    """NVML numbers GPUs in PCI bus order; the driver's minor numbers need not follow it."""
    h = Host(str(tmp_path), gpus=0)
    h.add_gpu(0, minor=1)
    h.add_gpu(1, minor=0)
    Path(h.config).write_bytes(chart_config({"name": NODE, "filterdevices": {"index": [0]}}))
    e = expectation(h.sources())
    assert e.want == 1
    assert [f.device for f in e.filtered] == [f"index 0, {UUIDS[0]}, {h.dev}/nvidia1"]


def test_no_config_another_node_or_no_node_name_subtracts_nothing_and_says_so(host: Host) -> None:
    assert expectation(host.sources()).want == 4
    assert "no HAMi node configuration at" in expectation(host.sources()).summary()
    Path(host.config).write_bytes(chart_config({"name": "elsewhere", "filterdevices": {"index": [0]}}))
    e = expectation(host.sources())
    assert e.want == 4 and f"no nodeconfig entry named {NODE}" in e.summary()
    e = expectation(host.sources(node=""))
    assert e.want == 4 and "the node's name is unknown (set NODE_NAME" in e.summary()


def test_without_the_drivers_gpu_list_each_filter_entry_counts_once(host: Host) -> None:
    for name in os.listdir(host.gpus):
        for f in os.listdir(os.path.join(host.gpus, name)):
            os.unlink(os.path.join(host.gpus, name, f))
        os.rmdir(os.path.join(host.gpus, name))
    os.rmdir(host.gpus)
    Path(host.config).write_bytes(
        chart_config({"name": NODE, "filterdevices": {"uuid": [UUIDS[1]], "index": [3, 99]}})
    )
    e = expectation(host.sources())
    assert e.want == 2  # index 99 names no GPU of four
    assert "taken as filtered" in e.summary() and "without matching UUIDs" in e.summary()


def test_mig_wants_at_least_one_and_vfio_bound_gpus_are_named(host: Host) -> None:
    Path(host.config).write_bytes(chart_config({"name": NODE, "operatingmode": "mig"}))
    pci = os.path.join(host.vfio, "0000:d8:00.0")
    os.makedirs(pci)
    Path(pci, "vendor").write_text("0x10de\n")
    Path(pci, "class").write_text("0x030200\n")
    e = expectation(host.sources())
    assert e.want == 1
    assert "HAMi registers MIG devices here (operatingmode mig" in e.summary()
    assert "1 NVIDIA GPU(s) bound to vfio-pci (handed to virtual machines)" in e.summary()
    assert "0000:d8:00.0" in e.summary()


def test_every_gpu_filtered_wants_none(host: Host) -> None:
    Path(host.config).write_bytes(chart_config({"name": NODE, "filterdevices": {"index": [0, 1, 2, 3]}}))
    assert expectation(host.sources()).want == 0


def test_hostile_files_never_raise(host: Host) -> None:
    Path(host.config).write_bytes(b"[" * 200_000)
    assert "filters nothing" in expectation(host.sources()).summary()
    Path(host.config).write_bytes(b" " * (2 << 20))
    assert "not read" in expectation(host.sources()).summary()
    os.unlink(host.config)
    os.mkdir(host.config)  # a folder where the file should be
    assert expectation(host.sources()).want == 4
    Path(host.gpus, BUSES[0], "information").write_bytes(os.urandom(4096))
    gpus, why = read_gpus(host.gpus)
    assert len(gpus) == 4 and why == ""


def test_the_fuzz_harness_holds_over_its_corpus_and_seeded_mutations() -> None:
    """The harness's invariants over the seed corpus and 3,000 seeded mutations of it (a fuzzer goes on)."""

    corpus = Path(__file__).parents[1] / "fuzz" / "corpus" / "hamiconfig"
    seeds = [p.read_bytes() for p in sorted(corpus.iterdir())]
    assert len(seeds) >= 5
    rng = random.Random(20)
    for seed in seeds:
        TestOneInput(seed)
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data) + 1)
            op = rng.randrange(3)
            if op == 0 and data:
                del data[at : at + rng.randint(1, 4)]
            elif op == 1:
                data[at:at] = rng.choice(
                    [b"[", b"{", b'"', b"-", b"1e999", b"null", b",", bytes([rng.randrange(256)])]
                )
            else:
                data[at:at] = rng.choice(seeds)[: rng.randint(0, 40)]
        TestOneInput(bytes(data))


def test_a_gpu_the_driver_excludes_is_not_expected(host: Host) -> None:
    info = Path(host.gpus, BUSES[0], "information")
    info.write_text(information(UUIDS[0], BUSES[0], 0, excluded="Yes"))
    Path(host.config).write_bytes(chart_config({"name": NODE, "filterdevices": {"index": [0]}}))
    e = expectation(host.sources())
    # NVML numbers the three it lists from 0: index 0 is the second bus's GPU.
    assert e.want == 2
    assert [f.device for f in e.filtered] == [
        f"index 0, {UUIDS[1]}, {host.dev}/nvidia1",
        f"{UUIDS[0]}, {host.dev}/nvidia0",
    ]
    assert e.filtered[1].why == "the driver excludes it"


def test_a_vendor_whose_plugin_reads_no_node_configuration_counts_its_device_nodes(tmp_path: Path) -> None:
    """Another vendor's profile (DCU's: render nodes, no HAMi node configuration, no PCI vendor known): auto
    is its device nodes, nothing subtracted and nothing said of a config; a vfio-bound GPU of another vendor
    is not named."""
    dcu = profiles.named("dcu")
    assert dcu is not None
    dri = tmp_path / "dev" / "dri"
    dri.mkdir(parents=True)
    for name in ("card0", "card1", "renderD128", "renderD129"):
        (dri / name).touch()
    vfio = tmp_path / "vfio-pci" / "0000:d8:00.0"
    vfio.mkdir(parents=True)
    (vfio / "vendor").write_text("0x10de\n")
    (vfio / "class").write_text("0x030200\n")
    glob = str(tmp_path / "dev" / "dri" / "renderD[0-9]*")
    e = expectation(Sources(glob, "", "node-1", "", str(tmp_path / "vfio-pci"), dcu))
    assert (e.want, e.host, e.notes, e.config) == (2, 2, (), "")
    assert e.summary() == "2 device node(s) on the host"
