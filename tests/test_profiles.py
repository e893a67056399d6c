"""The vendor profiles (hami_guard/profiles, docs/design.md#profiles).

The loader refuses each kind of bad entry, naming the file and the field; the names a profile defines
read both ways; profiles of other vendors' forms fit the schema as they are. Every consumer reads the
profile: a copy of the product whose only profile is another vendor's shows that vendor everywhere, and
so does the post-renderer given another copy. The post-renderer's copy is current, and the manifests
that must carry the default vendor's values (the kustomize component, the alerts, node-problem-detector's
command) hold the profile's. NVIDIA is named nowhere else in the product.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from doctor import patterns
from doctor.patterns import PLUGIN_PATTERNS
from hami_guard import profiles
from hami_guard.flags import PluginSpec
from hami_guard.profiles import DEFAULT, PROFILES, ProfileError, export, load, load_all
from sidecar.config import parse_settings
from sidecar.deviceplugin import naming
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "hami_guard" / "profiles"
NVIDIA = (FOLDER / "nvidia.toml").read_text()
PATCH = ROOT / "manifests" / "hami-patch"
SETS = ("nvidia",)  # the NVIDIA profile's
ALL_SETS = ("amd", "ascend", "biren", "dcu", "dpm", "nvidia")  # every shipped set
UUID = "GPU-6b8a5c0e-2f0e-4d4c-9c4b-0a1b2c3d4e5f"


def render_module() -> ModuleType:
    """manifests/hami-patch/render.py, imported from its file as the post-renderer runs it."""
    spec = importlib.util.spec_from_file_location("hami_patch_render", PATCH / "render.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the loader ----------------------------------------------------------------------------------------------
def test_the_shipped_profiles_load_and_nvidia_is_the_default() -> None:
    assert profiles.read() == PROFILES and PROFILES[0] is DEFAULT
    assert [p.name for p in PROFILES] == ["nvidia", "amd", "ascend", "biren", "dcu"]
    assert load(NVIDIA, "nvidia", SETS) == DEFAULT
    assert sorted(f.stem for f in (FOLDER / "patterns").glob("*.toml")) == list(ALL_SETS)
    assert DEFAULT.default and DEFAULT.doctor.log_patterns == SETS
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["hami_guard"]
    assert {"profiles/*.toml", "profiles/patterns/*.toml"} <= set(data)


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [
        ("[devices]\n", "[devices\n", "nvidia.toml: not valid TOML"),
        ('vendor = "NVIDIA"', 'vendr = "NVIDIA"', "nvidia.toml: vendor: missing"),
        ("default = true", "default = true\ncolour = 1", "nvidia.toml: unknown key colour (known: "),
        ("[chart]\n", "[charts]\n", "nvidia.toml: [chart]: missing"),
        ('control = "nvidiactl"', 'control = "nvidiactl"\ncontrl = ""', "[devices] unknown key contrl"),
        ('process = "nvidia-device-plugin"\n', "", "nvidia.toml: [doctor] process: missing"),
        ("default = true", 'default = "yes"', "nvidia.toml: default: must be true or false"),
        ('vendor = "NVIDIA"', 'vendor = ""', "nvidia.toml: vendor: must be a non-empty string"),
        ('vendor = "NVIDIA"', 'vendor = " NVIDIA"', "vendor: must be one line without leading or"),
        ('vendor = "NVIDIA"', 'vendor = ["NVIDIA"]', "nvidia.toml: vendor: must be a non-empty string"),
        (
            "[resources]\n",
            'resources = "nvidia.com/gpu"\n[resource]\n',
            "nvidia.toml: [resources]: must be a table",
        ),
        (
            'pattern = "nvidia.com/{name}"',
            'pattern = "nvidia.com/gpu"',
            "[resources] pattern: 'nvidia.com/gpu' must hold {name} once",
        ),
        (
            'pattern = "nvidia.com/{name}"',
            'pattern = "{name}"',
            "[resources] pattern: '{name}' must be <domain>/ then {name}",
        ),
        (
            'default = "nvidia.com/gpu"',
            'default = "amd.com/gpu"',
            "[resources] default: 'amd.com/gpu' is not of 'nvidia.com/{name}'",
        ),
        (
            'socket = "nvidia-{name}.sock"',
            'socket = "plugins/nvidia-{name}.sock"',
            "[resources] socket: 'plugins/nvidia-{name}.sock' is a file name: no /",
        ),
        ("id = 'GPU-", "id = '(GPU-", "[devices] id: not a regular expression"),
        ("folds = ['^({id})-", "folds = ['^{id}-", "[devices] folds[0]: must have one group, the device it"),
        ("'^(.+)::\\d+$'", "'^(.+)::(\\d+)$'", "[devices] folds[1]: must have one group"),
        ("'^(.+)::\\d+$'", "'^(.+::\\d+$'", "[devices] folds[1]: not a regular expression"),
        ("folds = [", "folds = 3\nfoldz = [", "[devices] folds: must be a list of regular expressions"),
        (
            'glob = "/dev/nvidia[0-9]*"',
            'glob = "dev/nvidia*"',
            "[devices] glob: 'dev/nvidia*' is not an absolute",
        ),
        ('node = "nvidia{minor}"', 'node = "nvidia0"', "[devices] node: 'nvidia0' must hold {minor} once"),
        (
            'control = "nvidiactl"',
            'control = "/dev/nvidiactl"',
            "[devices] control: '/dev/nvidiactl' is not a",
        ),
        (
            'pci_vendor = "0x10de"',
            'pci_vendor = "10de"',
            "[devices] pci_vendor: '10de' is not a PCI vendor ID",
        ),
        (
            'register = "hami.io/node-nvidia-register"',
            'register = "node-nvidia-register"',
            "[hami] register: 'node-nvidia-register' is not an annotation key",
        ),
        (
            'register_format = "device-info-json"',
            'register_format = "csv"',
            "[hami] register_format: 'csv' is not one of device-info-json, device-info-csv",
        ),
        (
            'handshake_writer = "scheduler"',
            'handshake_writer = "operator"',
            "[hami] handshake_writer: 'operator' is not one of device-plugin, scheduler, both",
        ),
        (
            'handshake = "hami.io/node-handshake"',
            'handshake = ""',
            "[hami] handshake_writer: a writer for a handshake, and none without one",
        ),
        ("stuck_cache = true", 'stuck_cache = "yes"', "[hami] stuck_cache: must be true or false"),
        ("stuck_cache = true\n", "", "nvidia.toml: [hami] stuck_cache: missing"),
        (
            "stamps_on_timer = false",
            'stamps_on_timer = "no"',
            "[hami] stamps_on_timer: must be true or false",
        ),
        (
            "stamps_on_timer = false",
            "stamps_on_timer = true",
            "[hami] stamps_on_timer: only a plugin that writes the handshake stamps it",
        ),
        (
            'container = "device-plugin"',
            'container = "Device_Plugin"',
            "[chart] container: 'Device_Plugin' is",
        ),
        ('namespace = "kube-system"', 'namespace = ""', "[chart] namespace: must be a non-empty string"),
        ('daemonset = ""', 'daemonset = "Hami"', "[chart] daemonset: 'Hami' is not a DaemonSet's name"),
        (
            'config_volume = "device-config"',
            'config_volume = ""',
            "[chart] resource_value: set with config_volume, or neither",
        ),
        (
            'node_config = "/config/config.json"',
            'node_config = "config.json"',
            "[chart] node_config: 'config",
        ),
        ("ports = [9394]", "ports = [0]", "[chart] ports: must be a list of ports (1 to 65535)"),
        ("ports = [9394]", 'ports = ["9394"]', "[chart] ports: must be a list of ports"),
        ("ports = [9394]", "ports = [true]", "[chart] ports: must be a list of ports"),
        ("bash = true", "bash = 1", "[chart] bash: must be true or false"),
        (
            'node_label = "gpu=on"',
            'node_label = "gpu"',
            "[chart] node_label: 'gpu' is not a node label key=value",
        ),
        ("host_network = false", 'host_network = "no"', "[chart] host_network: must be true or false"),
        ("host_network = false\n", "", "nvidia.toml: [chart] host_network: missing"),
        (
            'capacity = "nvidia_com_gpu|',
            'capacity = "nvidia.com/gpu|',
            "[resources] capacity: 'nvidia.com/gpu|nvidia_com_mig_[A-Za-z0-9_]+' does not match 'nvidia_com_",
        ),
        (
            'capacity = "nvidia_com_gpu|',
            'capacity = "(nvidia_com_gpu|',
            "[resources] capacity: not a regular expression",
        ),
        (
            'capacity = "nvidia_com_gpu|nvidia_com_mig_[A-Za-z0-9_]+"',
            """capacity = 'nvidia_com_gpu"'""",
            "[resources] capacity: 'nvidia_com_gpu\"' is not a regular expression without quotes",
        ),
        ('node = "nvidia{minor}"', 'node = ""', "[devices] node: missing for driver_gpus '/proc/driver"),
        (
            'socket = "nvidia-{name}.sock"',
            'socket = "nvidia-{name}.sock"\nname = "gpu[0-9]+"',
            "[resources] default: 'nvidia.com/gpu' is not of 'nvidia.com/{name}' ({name}: gpu[0-9]+)",
        ),
        (
            'socket = "nvidia-{name}.sock"',
            'socket = "nvidia-{name}.sock"\nname = "(x"',
            "[resources] name: not a",
        ),
        (
            'socket = "nvidia-{name}.sock"',
            'socket = "nvidia-{name}.sock"\nper_node = "no"',
            "[resources] per_node: must be true or false",
        ),
        (
            'selector = "app.kubernetes.io/component=hami-device-plugin"',
            'selector = "app.kubernetes.io/component"',
            "[chart] selector: 'app.kubernetes.io/component' is not a label selector key=value",
        ),
        (
            'resource_value = "nvidia.resourceCountName"',
            'resource_value = "nvidia..resourceCountName"',
            "[chart] resource_value: 'nvidia..resourceCountName' is not a dotted path",
        ),
        (
            'log_patterns = ["nvidia"]',
            'log_patterns = ["nvidia", "ascend"]',
            "[doctor] log_patterns[1]: 'ascend' names no set (patterns/ascend.toml)",
        ),
        ('log_patterns = ["nvidia"]', "log_patterns = []", "[doctor] log_patterns: must be a list of names"),
        (
            'gpu-kubelet-plugin = "gpu.nvidia.com"',
            'gpu-kubelet-plugin = "GPU NVIDIA"',
            "[dra] gpu-kubelet-plugin: 'GPU NVIDIA' is not a DRA driver's name",
        ),
        (
            'gpu-kubelet-plugin = "gpu.nvidia.com"',
            '"/bin/x" = "gpu.nvidia.com"',
            "'/bin/x' is not a program's",
        ),
        ("[sources]\n", "[sources]\nlinks = 4\n", "nvidia.toml: [sources] links: must be a non-empty string"),
    ],
)
def test_a_bad_profile_is_named(old: str, new: str, error: str) -> None:
    assert NVIDIA.count(old) == 1, old
    with pytest.raises(ProfileError, match=re.escape(error)):
        load(NVIDIA.replace(old, new), "nvidia", SETS)


def test_a_profiles_file_name_is_a_lowercase_name() -> None:
    with pytest.raises(
        ProfileError, match=re.escape("NVIDIA.toml: a profile's file name is a lowercase name")
    ):
        load(NVIDIA, "NVIDIA", SETS)


def test_optional_tables_and_fields() -> None:
    """Without DRA drivers, sources, device nodes, a driver's GPU list, a PCI vendor, a handshake or a device
    config, a profile still loads; the name of `{name}` and per_node have defaults."""
    text = NVIDIA[: NVIDIA.index("[dra]")]
    for old, new in (
        ('control = "nvidiactl"', 'control = ""'),
        ('driver_gpus = "/proc/driver/nvidia/gpus"', 'driver_gpus = ""'),
        ('glob = "/dev/nvidia[0-9]*"', 'glob = ""'),
        ('node = "nvidia{minor}"', 'node = ""'),
        ('pci_vendor = "0x10de"', 'pci_vendor = ""'),
        ('handshake = "hami.io/node-handshake"', 'handshake = ""'),
        ('handshake_writer = "scheduler"', 'handshake_writer = ""'),
        ('config_volume = "device-config"', 'config_volume = ""'),
        ('resource_value = "nvidia.resourceCountName"', 'resource_value = ""'),
        ('node_config = "/config/config.json"', 'node_config = ""'),
        ("ports = [9394]", "ports = []"),
        ('node_label = "gpu=on"', 'node_label = ""'),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    p = load(text, "nvidia", SETS)
    assert (p.dra, p.sources, p.devices.control, p.devices.driver_gpus) == ((), (), "", "")
    assert (p.devices.glob, p.devices.node, p.devices.pci_vendor, p.hami.handshake, p.chart.ports) == (
        "",
        "",
        "",
        "",
        (),
    )
    assert (p.resources.name, p.resources.per_node) == (profiles.NAME_EXPRESSION, False)
    assert p.handshake_key("nvidia.com/gpu") == ""
    assert p.chart.node_label == ""


def test_profiles_are_checked_together() -> None:
    other = (
        NVIDIA.replace("nvidia.com/", "example.com/")
        .replace("nvidia_com_", "example_com_")
        .replace("default = true", "default = false")
    )
    assert [p.name for p in load_all({"other": other, "nvidia": NVIDIA}, SETS)] == ["nvidia", "other"]
    with pytest.raises(ProfileError, match=re.escape("exactly one profile must be the default")):
        load_all({"other": NVIDIA.replace("default = true", "default = false")}, SETS)
    with pytest.raises(ProfileError, match=re.escape("(default = true): nvidia.toml, other.toml")):
        load_all({"other": other.replace("default = false", "default = true"), "nvidia": NVIDIA}, SETS)
    twin = NVIDIA.replace("default = true", "default = false")
    with pytest.raises(
        ProfileError, match=re.escape("twin.toml [resources] default: 'nvidia.com/gpu' is also")
    ):
        load_all({"twin": twin, "nvidia": NVIDIA}, SETS)
    # kube-state-metrics' names too: another's capacity must not take NVIDIA's nodes for its own.
    greedy = other.replace('capacity = "example_com_gpu|', 'capacity = "[a-z]+_com_gpu|')
    with pytest.raises(
        ProfileError,
        match=re.escape("other.toml [resources] capacity: '[a-z]+_com_gpu|example_com_mig_[A-Za-z0-9_]+' "),
    ):
        load_all({"other": greedy, "nvidia": NVIDIA}, SETS)


# -- the names, read both ways -------------------------------------------------------------------------------
def test_the_default_profiles_names_read_both_ways() -> None:
    p = DEFAULT
    assert p.socket_for("nvidia.com/vgpu") == "nvidia-vgpu.sock"
    assert p.socket_for("example.com/gpu") == "nvidia-gpu.sock"  # HAMi names it after the name alone
    assert p.resource_for("nvidia-vgpu.sock") == "nvidia.com/vgpu"
    assert [p.resource_for(s) for s in ("nvidia-.sock", "nvidia-a/b.sock", "gpu.sock")] == [None] * 3
    assert (p.owns("nvidia.com/gpu"), p.owns("nvidia.comx/gpu"), p.owns("amd.com/gpu")) == (
        True,
        False,
        False,
    )
    assert p.register_key("nvidia.com/vgpu") == "hami.io/node-nvidia-register"
    assert p.physical_device(f"{UUID}-3") == UUID
    assert p.physical_device("MIG-1::2") == "MIG-1"
    assert p.physical_device("MIG-1-2") == "MIG-1-2"  # only a UUID's split is folded
    assert (p.is_device(UUID), p.is_device(f"{UUID}-1")) == (True, False)
    assert p.shown(p.resources.socket) == "nvidia-<name>.sock"


def test_each_vendors_names_read_both_ways() -> None:
    """The shipped profiles of the vendors HAMi supports: each resource's socket and back (Ascend's
    <CommonWord>.sock, device-plugin-manager's <domain>_<name>), HAMi's keys, the folds of their split IDs
    (Ascend's <UUID>-<i>, DCU's <id>-fake-<i>, AMD's <bus ID>#<n>), and which owns what."""
    ascend, dcu, amd, biren = (profiles.named(n) for n in ("ascend", "dcu", "amd", "biren"))
    assert ascend and dcu and amd and biren
    assert ascend.socket_for("huawei.com/Ascend910B3") == "Ascend910B3.sock"
    assert ascend.resource_for("Ascend310P.sock") == "huawei.com/Ascend310P"
    assert ascend.resource_for("Ascend910B4-1.sock") == "huawei.com/Ascend910B4-1"
    # Only the chart's commonWords: another plugin's <name>.sock is not an NPU's.
    assert [ascend.resource_for(s) for s in ("kubelet.sock", "cambricon.sock", "nvidia-gpu.sock")] == [
        None
    ] * 3
    assert (ascend.owns("huawei.com/Ascend910A"), ascend.owns("huawei.com/npu")) == (True, False)
    assert ascend.register_key("huawei.com/Ascend910B3") == "hami.io/node-register-Ascend910B3"
    assert ascend.handshake_key("huawei.com/Ascend310P") == "hami.io/node-handshake-Ascend310P"
    assert ascend.physical_device("a1b2-c3-7") == "a1b2-c3"
    assert ascend.resources.per_node and ascend.free_port() == 9396  # its vNPU metrics listen on 9395

    assert dcu.socket_for("hygon.com/dcunum") == "hygon.com_dcunum"
    assert dcu.resource_for("hygon.com_dcunum") == "hygon.com/dcunum"
    assert dcu.physical_device("DCU-1234ABCD-fake-3") == "DCU-1234ABCD"
    assert dcu.physical_device("DCU-1234ABCD-3") == "DCU-1234ABCD-3"  # NVIDIA's split form is not DCU's
    assert (dcu.register_key("hygon.com/dcunum"), dcu.hami.register_format) == (
        "hami.io/node-dcu-register",
        "device-info-csv",
    )
    assert dcu.handshake_key("hygon.com/dcunum") == "hami.io/node-handshake-dcu"

    assert amd.socket_for("amd.com/gpu") == "amd.com_gpu"
    assert amd.resource_for("amd.com_gpu") == "amd.com/gpu"
    assert amd.physical_device("0000:c1:00.0#9") == "0000:c1:00.0"
    assert amd.is_device("0000:c1:00.0") and not amd.is_device("0000:c1:00.0#9")
    assert (amd.handshake_key("amd.com/gpu"), amd.hami.handshake_writer) == ("", "")  # HAMi has none

    assert biren.socket_for("birentech.com/gpu") == "birentech.com_gpu"
    assert biren.resource_for("birentech.com_1-2-gpu") == "birentech.com/1-2-gpu"
    assert biren.physical_device("card_3") == "card_3"
    assert biren.handshake_key("birentech.com/gpu") == "hami.io/node-handshake-biren"

    # Each socket is read by its own profile, and each resource owned by one.
    for socket, resource in (
        ("nvidia-gpu.sock", "nvidia.com/gpu"),
        ("Ascend910B3.sock", "huawei.com/Ascend910B3"),
        ("hygon.com_dcunum", "hygon.com/dcunum"),
        ("amd.com_gpu", "amd.com/gpu"),
        ("birentech.com_gpu", "birentech.com/gpu"),
    ):
        found = profiles.for_socket(socket)
        assert found is not None and found[1] == resource
        assert profiles.for_resource(resource) is found[0]
    assert profiles.for_socket("kubelet.sock") is None
    # Only NVIDIA's plugin caches its annotation before the patch (the stuck-cache defect).
    assert [p.name for p in PROFILES if p.hami.stuck_cache] == ["nvidia"]
    assert sorted(p.name for p in PROFILES if p.hami.stamps_on_timer) == ["ascend", "dcu"]


def test_split_ids_fold_by_the_resources_vendor() -> None:
    """The kubelet's device IDs fold by the profile of their resource (sidecar/deviceplugin/naming.py):
    AMD's <bus ID>#<n> and DCU's <id>-fake-<i> count once per device there, never under another vendor's
    resource; without a resource, the default profile's (NVIDIA's <UUID>-<n>)."""
    amd_ids = ["0000:c1:00.0#0", "0000:c1:00.0#1", "0000:c2:00.0#0"]
    assert naming.physical_devices(amd_ids, "amd.com/gpu") == {"0000:c1:00.0", "0000:c2:00.0"}
    assert len(naming.physical_devices(amd_ids)) == 3
    dcu_ids = [f"DCU-77-fake-{i}" for i in range(4)]
    assert naming.physical_devices(dcu_ids, "hygon.com/dcunum") == {"DCU-77"}
    assert len(naming.physical_devices(dcu_ids, "nvidia.com/gpu")) == 4
    assert naming.physical_devices([f"{UUID}-1", f"{UUID}-2"]) == {UUID}
    assert naming.physical_devices([f"{UUID}-1"], "birentech.com/gpu") == {f"{UUID}-1"}
    ascend = profiles.named("ascend")
    assert (
        naming.physical_device("x-1-3", "huawei.com/Mine", vendor=ascend) == "x-1"
    )  # --vendor's for its own


def test_device_plugin_managers_sockets_read_as_their_resources() -> None:
    """<domain>_<name> (kubevirt's device-plugin-manager) is the resource <domain>/<name> for any vendor;
    a name without a dotted domain (kubelet_internal_checkpoint) is none."""
    assert naming.hami_resource("example.org_vpu") == "example.org/vpu"
    assert naming.hami_resource("amd.com_gpu") == "amd.com/gpu"
    assert naming.hami_resource("kubelet_internal_checkpoint") is None
    assert naming.hami_resource("kubelet.sock") is None
    spec = PluginSpec("example.org/gpu", "example.org_gpu")
    assert naming.pick_found(spec, ["a.sock", "example.org_vpu"]) == "example.org_vpu"
    said = naming.socket_found_instead([spec], spec, "example.org_vpu")
    assert "(device-plugin-manager serves <domain>_<name> for <domain>/<name>: example.org/vpu)" in said
    assert "HAMI_GUARD_PLUGIN=example.org/vpu=example.org_vpu" in said
    ascend = PluginSpec("huawei.com/Ascend910B3", "Ascend910B3.sock")
    said = naming.socket_found_instead([ascend], ascend, "Ascend310P.sock")
    assert "(HAMi serves <name>.sock for resourceName huawei.com/<name>: huawei.com/Ascend310P)" in said


def test_each_vendors_log_patterns_are_its_own() -> None:
    """Every profile's catalogue loads (at import), with its plugin's lines; device-plugin-manager's lines
    are the DCU, AMD and Biren plugins' alike; the restart command names the vendor's pods."""
    lines = {p.name: {x.text for x in patterns.catalogue(p).plugin} for p in PROFILES}
    assert "Registered device plugin for" in lines["nvidia"]
    assert "register HAMi error:" in lines["ascend"] and "Registered device plugin for" not in lines["ascend"]
    for name in ("dcu", "amd", "biren"):
        assert ": Registration failed:" in lines[name], name
        assert "Registered device plugin for" not in lines[name]
    assert "Error opening /dev/kfd" in lines["dcu"]
    assert "amdgpu driver unavailable" in lines["amd"]
    assert "brml init failed" in lines["biren"]
    restart = patterns.catalogue(profiles.named("biren")).texts["restart-plugin"]
    assert "$ kubectl -n biren-gpu delete pod -l name=biren-device-plugin " in restart
    assert patterns.catalogue(None) is patterns.CATALOGUE  # a vendor without a profile: the default's


# -- every consumer reads the profile ------------------------------------------------------------------------
# Another vendor in NVIDIA's place: every value differs from NVIDIA's.
ACME = """
vendor = "ACME"
default = true
[resources]
pattern = "acme.example/{name}"
default = "acme.example/xpu"
socket = "acme_{name}.socket"
capacity = "acme_example_[a-z]+"
[devices]
id = 'XPU-[0-9]{4}'
folds = ['^({id})#\\d+$']
glob = "/dev/acme-xpu[0-9]*"
node = "acme-xpu{minor}"
control = "acme-ctl"
driver_gpus = "/proc/acme/xpus"
pci_vendor = "0x1234"
check = "acme-smi"
inspect = "acme-smi --all"
[hami]
register = "hami.io/node-register-{name}"
register_format = "device-info-json"
register_writer = "device-plugin"
handshake = "hami.io/node-handshake-acme"
handshake_writer = "scheduler"
stuck_cache = false
stamps_on_timer = false
[chart]
selector = "app.kubernetes.io/component=acme-device-plugin"
daemonset = ""
container = "device-plugin"
namespace = "acme-system"
config_volume = "device-config"
resource_value = "acme.resourceName"
node_config = "/etc/acme/config.json"
ports = [9395, 9396]
bash = false
node_label = "acme.example/xpu.present=true"
host_network = false
[doctor]
process = "acme-device-plugin"
log_patterns = ["acme"]
[dra]
acme-kubelet-plugin = "xpu.acme.example"
"""

# Run in the copy: what each consumer says, as JSON.
CONSUMERS = r"""
import json, os, sys
folder = sys.argv[1]
out = {}
from hami_guard import profiles
out["where"] = profiles.__file__
from sidecar.config import DEFAULTS, build_parser, read_settings
out["plugins"] = [list(p) for p in DEFAULTS.plugins]
out["glob"] = DEFAULTS.device_glob
out["driver_gpus_dir"] = DEFAULTS.driver_gpus_dir
out["hami_keys"] = [list(k) for k in DEFAULTS.hami_keys()]
out["handshake"] = DEFAULTS.hami_handshake_annotation
out["port"] = [DEFAULTS.port, read_settings([], {}).port]
out["hami_config"] = [DEFAULTS.hami_config, read_settings([], {}).hami_config]
out["vendor"] = [DEFAULTS.vendor, read_settings([], {}).vendor]
out["help"] = " ".join(build_parser().format_help().split())
out["plugin_error"] = read_settings(["--plugin", "bad"], {}).error
out["dra_error"] = read_settings(["--dra-driver", "a b"], {}).error
from sidecar.deviceplugin import naming
spec = DEFAULTS.plugins[0]
out["hami_resource"] = naming.hami_resource("acme_vpu.socket")
out["physical"] = sorted(naming.physical_devices(["XPU-0001#1", "XPU-0001#2", "XPU-0002"]))
out["instead"] = naming.socket_found_instead([spec], spec, "acme_vpu.socket")
out["pick"] = naming.pick_found(spec, ["b.sock", "acme_vpu.socket"])
from sidecar.deviceplugin import hamiconfig, hostdevices
out["gpus_dir"] = hamiconfig.Sources("x").gpus_dir
out["node"] = hostdevices.Gpu("b", minor=3).node("/d")
vfio = os.path.join(folder, "vfio")
os.makedirs(os.path.join(vfio, "0000:01:00.0"))
for name, text in (("vendor", "0x1234\n"), ("class", "0x030000\n")):
    with open(os.path.join(vfio, "0000:01:00.0", name), "w") as f:
        f.write(text)
out["vfio"] = hamiconfig.expectation(hamiconfig.Sources(os.path.join(folder, "x*"), vfio_dir=vfio)).notes[0]
from sidecar.hami.annotation import gpu_of
out["gpu_of"] = [gpu_of("XPU-0001-2"), gpu_of("XPU-0001")]
from sidecar.deviceplugin.probes import Reading
from sidecar.deviceplugin.recovery import DeviceRecovery, RecoveryEvidence
rec = DeviceRecovery(spec.resource, 60.0, 3, str)
ev = RecoveryEvidence(Reading({}), Reading(frozenset({"XPU-0001"})))
out["host_says"] = rec._host_says(["XPU-0001"], ev)
from doctor.settings import DEFAULTS as DOCTOR
out["process"] = DOCTOR.plugin_process_name
from doctor import patterns
out["restart"] = patterns.RESTART_PLUGIN
out["other"] = patterns.OTHER_PLUGIN_FIX[0]
out["plugin_lines"] = [p.text for p in patterns.PLUGIN_PATTERNS]
out["register_fix"] = [p.fix for p in patterns.KUBELET_PATTERNS if p.text.startswith("Bad registration")][0]
dev = os.path.join(folder, "dev")
os.makedirs(dev)
for name in ("acme-ctl", "acme-xpu0", "acme-xpu1", "nvidia0"):
    open(os.path.join(dev, name), "w").close()
from doctor.evidence import driver_nodes
from doctor.causes import driver_cause
from doctor.types import DriverNodes
nodes = driver_nodes(os.path.join(dev, "acme-xpu[0-9]*"))
out["nodes"] = [nodes.control, [os.path.basename(g) for g in nodes.gpus]]
out["driver_cause"] = driver_cause((), DriverNodes(True, "/dev", False, (), "acme-ctl", "ACME")).evidence
from doctor.recovery import recovery_cause
doc = {spec.resource: {"really_unhealthy": {"XPU-0001": 1.0}}}
out["doctor_recovery"] = recovery_cause(Reading(doc)).fix
from manifests.monitoring import vendors
out["cluster"] = vendors.cluster_rule(profiles.DEFAULT, ())
out["policy"] = vendors.policy(profiles.DEFAULT)
out["unrecoverable"] = vendors.unrecoverable_rule()
print(json.dumps(out))
"""


def product_copy(tmp_path: Path) -> Path:
    """The product's packages in `tmp_path`/lib, ACME's profile in NVIDIA's place (the default)."""
    lib = tmp_path / "lib"
    for package in ("hami_guard", "sidecar", "doctor", "initcheck"):
        shutil.copytree(ROOT / package, lib / package, ignore=shutil.ignore_patterns("__pycache__"))
    (lib / "manifests" / "monitoring").mkdir(parents=True)
    shutil.copy(ROOT / "manifests" / "monitoring" / "vendors.py", lib / "manifests" / "monitoring")
    folder = lib / "hami_guard" / "profiles"
    (folder / "nvidia.toml").unlink()
    (folder / "acme.toml").write_text(ACME)
    nvidia_set = (folder / "patterns" / "nvidia.toml").read_text()
    (folder / "patterns" / "nvidia.toml").unlink()
    (folder / "patterns" / "acme.toml").write_text(nvidia_set.replace("NVIDIA", "ACME"))
    return lib


def test_every_consumer_reads_the_profile(tmp_path: Path) -> None:
    """The product with ACME's profile in NVIDIA's place: each consumer says ACME's names, none NVIDIA's."""
    lib = product_copy(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(lib), "PYTHONNOUSERSITE": "1"}
    result = subprocess.run(  # from tmp_path: the checkout's packages are not on the path
        [sys.executable, "-c", CONSUMERS, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out.pop("where") == str(lib / "hami_guard" / "profiles" / "__init__.py")
    assert out.pop("plugins") == [["acme.example/xpu", "acme_xpu.socket"]]
    assert out.pop("glob") == "/dev/acme-xpu[0-9]*"
    assert out.pop("driver_gpus_dir") == out.pop("gpus_dir") == "/proc/acme/xpus"
    assert out.pop("hami_keys") == [["acme.example/xpu", "hami.io/node-register-xpu"]]
    assert out.pop("handshake") == "hami.io/node-handshake-acme"
    assert out.pop("port") == [9397, 9397]  # past ACME's own ports, 9395 and 9396
    assert out.pop("hami_config") == ["/etc/acme/config.json"] * 2
    assert out.pop("vendor") == ["acme"] * 2
    help_text = out.pop("help")
    assert "(default acme.example/xpu=acme_xpu.socket)" in help_text
    assert "(default /dev/acme-xpu[0-9]*: the vendor profile's, under --host-dev)" in help_text
    assert "else acme)" in help_text
    assert "hami.io/node-register-{name} for acme.example/* resources" in help_text
    assert "(acme.example/xpu=acme_xpu.socket), got 'bad'" in out.pop("plugin_error")
    assert "(xpu.acme.example=xpu.acme.example-reg.sock), got 'a b'" in out.pop("dra_error")
    assert out.pop("hami_resource") == "acme.example/vpu"
    assert out.pop("physical") == ["XPU-0001", "XPU-0002"]
    assert (
        "(HAMi serves acme_<name>.socket for resourceName acme.example/<name>: acme.example/vpu)"
        in out.pop("instead")
    )
    assert out.pop("pick") == "acme_vpu.socket"
    assert out.pop("node") == "/d/acme-xpu3"
    assert out.pop("vfio").startswith("1 ACME GPU(s) bound to vfio-pci")
    assert out.pop("gpu_of") == ["XPU-0001", "XPU-0001"]
    assert out.pop("host_says") == "the ACME driver still lists them"
    assert out.pop("process") == "acme-device-plugin"
    assert "-l app.kubernetes.io/component=acme-device-plugin " in out.pop("restart")
    assert "(the GPU Operator's ACME plugin beside HAMi)" in out.pop("other")
    assert out.pop("plugin_lines") == [p.text for p in PLUGIN_PATTERNS]  # the set the profile names
    assert out.pop("register_fix")[0].endswith("(HAMi chart: resourceName, e.g. acme.example/xpu)")
    assert out.pop("nodes") == [True, ["acme-xpu0", "acme-xpu1"]]
    assert out.pop("driver_cause") == [
        "no /dev/acme-ctl on the host: the ACME driver is not loaded, or this node has no GPU"
    ]
    assert out.pop("doctor_recovery")[0] == "look at the GPU: acme-smi --all"
    # The monitoring's generator (manifests/monitoring/vendors.py): ACME's cluster rule, NetworkPolicy, and
    # its command first where an unrecoverable device's fix is told.
    cluster = out.pop("cluster")
    assert 'kube_node_labels{label_acme_example_xpu_present="true"}' in cluster
    assert 'kube_node_status_capacity{resource=~"acme_example_[a-z]+", unit="integer"}' in cluster
    assert "vendor: acme\n" in cluster and "ACME node {{ $labels.node }}" in cluster
    assert "has no acme.example/xpu capacity" in cluster and "itself: acme-smi." in cluster
    policy = out.pop("policy")
    assert policy["metadata"]["name"] == "hami-guard"
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/component": "acme-device-plugin"}
    }
    assert [[p["port"] for p in r["ports"]] for r in policy["spec"]["ingress"]] == [[9397], [9395, 9396]]
    assert "({{ if match `^acme\\.example/(?:" in out.pop("unrecoverable").replace("\n", " ")
    assert out == {}


def test_the_post_renderer_reads_its_copy_of_the_profiles(tmp_path: Path) -> None:
    """render.py with ACME's profile as its copy: ACME's DaemonSet is found by ACME's label, its resource
    read where ACME's chart sets it, its socket ACME's, the sidecar on a port none of ACME's containers
    has, an httpGet liveness (ACME's image has no bash), and ACME's DRA driver known."""
    require_tool("kubectl")
    plugin = tmp_path / "hami-patch"
    shutil.copytree(PATCH, plugin)
    (plugin / "profiles.json").write_text(export([load(ACME, "acme", ["acme"])]))
    chart = (ROOT / "manifests" / "example-hami" / "hami.yaml").read_text()
    chart = chart.replace("component: hami-device-plugin", "component: acme-device-plugin")
    old = "    nvidia:\n      resourceCountName: nvidia.com/gpu\n"
    assert chart.count(old) == 1
    chart = chart.replace(old, "    acme:\n      resourceName: acme.example/vpu\n")
    driver = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "acme-kubelet-plugin", "namespace": "acme"},
        "spec": {
            "selector": {"matchLabels": {"app": "acme"}},
            "template": {
                "metadata": {"labels": {"app": "acme"}},
                "spec": {
                    "containers": [{"name": "xpus", "image": "acme", "command": ["acme-kubelet-plugin"]}],
                    "volumes": [
                        {
                            "name": "plugins-registry",
                            "hostPath": {"path": "/var/lib/kubelet/plugins_registry"},
                        },
                        {"name": "plugins", "hostPath": {"path": "/var/lib/kubelet/plugins"}},
                    ],
                },
            },
        },
    }
    chart += "---\n" + yaml.safe_dump(driver)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_GUARD_")}
    result = subprocess.run(
        [sys.executable, str(plugin / "render.py"), "registry=registry.example.org"],
        input=chart,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    ds = {
        o["metadata"]["name"]: o for o in yaml.safe_load_all(result.stdout) if o and o["kind"] == "DaemonSet"
    }
    pod = ds["hami-device-plugin"]["spec"]["template"]["spec"]
    sidecar = {c["name"]: c for c in pod["initContainers"]}["hami-sidecar"]
    env_of = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env_of["HAMI_GUARD_PLUGIN"] == "acme.example/vpu=acme_vpu.socket"
    assert "HAMI_GUARD_VENDOR" not in env_of  # ACME is the default here
    assert (env_of["HAMI_GUARD_HOST_DEV"], env_of["HAMI_GUARD_LISTEN"]) == ("/host/dev", "0.0.0.0:9397")
    plugin_container = {c["name"]: c for c in pod["containers"]}["device-plugin"]
    assert plugin_container["readinessProbe"]["httpGet"] == {"path": render_module().READINESS, "port": 9397}
    assert plugin_container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9397}
    driver_pod = ds["acme-kubelet-plugin"]["spec"]["template"]["spec"]
    dra_sidecar = {c["name"]: c for c in driver_pod["initContainers"]}["hami-sidecar"]
    assert {"name": "HAMI_GUARD_DRA_DRIVER", "value": "xpu.acme.example"} in dra_sidecar["env"]
    # The default vendor's label no longer finds anything.
    nothing = subprocess.run(
        [sys.executable, str(plugin / "render.py"), "registry=registry.example.org"],
        input=(ROOT / "manifests" / "example-hami" / "hami.yaml").read_text(),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert "no DaemonSet labelled app.kubernetes.io/component=acme-device-plugin (or" in nothing.stderr


# -- the copies and the manifests ----------------------------------------------------------------------------
def test_the_post_renderers_copy_is_current() -> None:
    """manifests/hami-patch/profiles.json is `make profiles`' output (render.py cannot import the package)."""
    assert (PATCH / "profiles.json").read_text() == export(PROFILES), "run make profiles"
    assert json.loads((PATCH / "profiles.json").read_text())["profiles"]["nvidia"] == DEFAULT.as_data()


def test_the_vendors_components_are_current(tmp_path: Path) -> None:
    """manifests/hami-patch/vendors/<vendor> is `make profiles`' output (render.py components): the kustomize
    component of each vendor but the default one."""
    require_tool("kubectl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAMI_GUARD_")}
    result = subprocess.run(
        [sys.executable, str(PATCH / "render.py"), "components", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    written = {str(p.relative_to(tmp_path)): p.read_text() for p in sorted(tmp_path.rglob("*.yaml"))}
    folder = PATCH / "vendors"
    shipped = {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*.yaml"))}
    assert written == shipped, "run make profiles"
    assert sorted({k.split("/")[0] for k in written}) == sorted(p.name for p in PROFILES if not p.default)


def test_the_manifests_name_no_vendor() -> None:
    """The static manifests name no vendor: the kustomize component's patch leaves the plugin, the device
    nodes and HAMi's node configuration to the sidecar's vendor profile (HAMI_GUARD_VENDOR, the default
    when unset), under the host's /dev where it mounts it; its readiness path excludes kinds of checks,
    no resource; node-problem-detector's rule passes the host's /dev, not a glob."""
    render = render_module()
    assert DEFAULT.resources.default == render.DEFAULT_RESOURCE
    assert DEFAULT.name == render.DEFAULT_VENDOR
    assert dict(DEFAULT.dra) == render.DRA_BINARIES
    # The kustomize component.
    component = yaml.safe_load((PATCH / "kustomization.yaml").read_text())
    assert [p["target"]["labelSelector"] for p in component["patches"]] == [DEFAULT.chart.selector]
    patch = yaml.safe_load((PATCH / "patch.yaml").read_text())
    pod = patch["spec"]["template"]["spec"]
    sidecar = {c["name"]: c for c in pod["initContainers"]}["hami-sidecar"]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    vendors = {"HAMI_GUARD_PLUGIN", "HAMI_GUARD_DEVICE_GLOB", "HAMI_GUARD_VENDOR", "HAMI_GUARD_HAMI_CONFIG"}
    assert not vendors & set(env)
    assert env["HAMI_GUARD_HOST_DEV"] == render.HOST_DEV
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert mounts["hami-guard-host-dev"] == render.HOST_DEV
    assert mounts["deviceconfig"] == os.path.dirname(DEFAULT.chart.node_config)
    ready = {c["name"]: c for c in pod["containers"]}["device-plugin"]["readinessProbe"]["httpGet"]["path"]
    assert ready == render.READINESS and "/" not in ready.partition("?")[2]
    # What the sidecar makes of the patch's variables: the default vendor's names, under /host/dev.
    read = parse_settings([], {k: v for k, v in env.items() if isinstance(v, str)})
    resource = DEFAULT.resources.default
    assert read.plugins == ((resource, DEFAULT.socket_for(resource)),)
    assert read.device_glob == render.HOST_DEV + DEFAULT.devices.glob.removeprefix("/dev")
    assert read.hami_config == DEFAULT.chart.node_config
    # node-problem-detector runs hami-doctor on the host's /dev, mounted where the sidecar has it.
    npd = json.loads((ROOT / "manifests" / "npd" / "hami-guard-monitor.json").read_text())
    (args,) = [r["args"] for r in npd["rules"]]
    assert args[args.index("--host-dev") + 1] == render.HOST_DEV and "--device-glob" not in args
    # The cluster rule, one per profile (written from the profiles; test_monitoring checks it current): the
    # profile's node label and its resources as kube-state-metrics names them, the resource in its texts;
    # the default vendor's first, its resource kube-state-metrics' name of the chart's default.
    rules = yaml.safe_load((ROOT / "manifests" / "monitoring" / "prometheusrule.yaml").read_text())
    cluster = {
        r["labels"]["vendor"]: r
        for g in rules["spec"]["groups"]
        for r in g["rules"]
        if r.get("alert") == "HamiGPUNodeWithoutGPUCapacity"
    }
    assert list(cluster) == [p.name for p in PROFILES]
    for p in PROFILES:
        rule = cluster[p.name]
        key, _, value = p.chart.node_label.partition("=")
        capacity = f'kube_node_status_capacity{{resource=~"{p.resources.capacity}", unit="integer"}}) > 0'
        assert f'{key.replace(".", "_").replace("/", "_").replace("-", "_")}="{value}"' in rule["expr"]
        assert f"unless on (node) max by (node) ({capacity}" in rule["expr"]
        shown = p.shown(p.resources.pattern) if p.resources.per_node else p.resources.default
        assert f"{p.vendor} node {{{{ $labels.node }}}}" in rule["annotations"]["summary"]
        assert f"has no {shown} capacity" in rule["annotations"]["summary"]
        assert p.devices.check in rule["annotations"]["description"]
    assert re.fullmatch(DEFAULT.resources.capacity, profiles.sanitized(resource))
    # The dashboard (generated by dashboard.py, which reads the profiles; test_monitoring checks it current).
    dashboard = (ROOT / "manifests" / "monitoring" / "dashboard.json").read_text()
    assert (
        DEFAULT.register_key(resource) in dashboard
        and f"{DEFAULT.chart.node_label}: {resource};" in dashboard
    )


def test_nvidia_is_named_only_in_its_profile() -> None:
    """The product, the post-renderer's folder and node-problem-detector's manifests name NVIDIA only in its
    profile, the profile's log patterns and the post-renderer's generated copy. (The alerts of
    manifests/monitoring carry the default resource, checked above; manifests/example-hami is HAMi's chart
    rendered.)"""
    allowed = {
        "hami_guard/profiles/nvidia.toml",
        "hami_guard/profiles/patterns/nvidia.toml",
        "manifests/hami-patch/profiles.json",
    }
    found = set()
    for top in ("hami_guard", "sidecar", "doctor", "initcheck", "manifests/hami-patch", "manifests/npd"):
        for path in (ROOT / top).rglob("*"):
            readable = path.is_file() and "__pycache__" not in path.parts and path.suffix != ".md"
            if readable and b"nvidia" in path.read_bytes():
                found.add(str(path.relative_to(ROOT)))
    assert found == allowed
