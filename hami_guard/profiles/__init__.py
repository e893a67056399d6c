"""Vendor profiles: what hami-guard knows of a vendor's devices under HAMi, as data (docs/design.md#profiles).

Each `<name>.toml` beside this module is one profile: the resources HAMi's plugin registers and its
socket for each, the device IDs and nodes, HAMi's Node annotations, the chart's DaemonSet, what the
doctor reads. They are read once, at import, and every field is checked: a bad one is a
`ProfileError` naming the file and the field, so a bad profile stops the programs at import, never
mid-round. The programs read the profile that owns a resource (`for_resource`) where they have one,
and the default profile (`DEFAULT`) for their defaults; no vendor's name or path is written in the code.

Standard library only (tomllib), like the rest of hami_guard; initcheck never imports it.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from importlib import resources
from typing import Any, TypeVar

NAME = "{name}"  # in a resource, socket or annotation pattern: the resource's name, after the "/"
MINOR = "{minor}"  # in a device node pattern: the GPU's minor number
ID = "{id}"  # in a fold: the profile's device ID expression
# What `{name}` stands for: the name part of an extended resource name (a Kubernetes qualified name).
NAME_EXPRESSION = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"
# The register annotation's formats sidecar/hami/annotation.py reads, and who writes each annotation.
REGISTER_FORMATS = ("device-info-json", "device-info-csv")
# Who writes an annotation: the device plugin, the scheduler, or both (a handshake the plugin stamps
# `Reported` and the scheduler `Requesting_`).
WRITERS = ("device-plugin", "scheduler", "both")
SIDECAR_PORT = 9395  # hami-sidecar's port where the vendor's own ports leave it free (free_port)
PATTERNS = "patterns"  # the folder of the doctor's log-pattern sets, `<set>.toml`
SUFFIX = ".toml"

_DOMAIN = r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*"
_KEY = re.compile(rf"^{_DOMAIN}/[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_LABEL = re.compile(
    rf"^({_DOMAIN}/)?[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?=[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$"
)
_WORD = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_PROGRAM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*$")
_PCI_VENDOR = re.compile(r"^0x[0-9a-f]{4}$")

T = TypeVar("T")


class ProfileError(ValueError):
    """A bad profile: the file, the field, and what is wrong with it."""


@dataclass(frozen=True)
class Resources:
    """The extended resources HAMi's plugin registers, and its socket for each."""

    pattern: str  # `vendor.example/{name}`
    default: str  # the chart's default resource: of `pattern`
    socket: str  # the socket's name for the resource <domain>/{name}
    # The resources as kube-state-metrics labels them in kube_node_status_capacity (`resource`, sanitized:
    # `vendor_example_gpu`): a regular expression, matched whole, that PromQL's RE2 reads too.
    capacity: str
    name: str = NAME_EXPRESSION  # what `{name}` may be (a regular expression)
    per_node: bool = False  # each node registers the resource of its hardware: no one default fits all

    @cached_property
    def _socket(self) -> re.Pattern[str]:
        head, _, tail = self.socket.partition(NAME)
        return re.compile(f"^{re.escape(head)}((?:{self.name})){re.escape(tail)}$")

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        head, _, tail = self.pattern.partition(NAME)
        return re.compile(f"^{re.escape(head)}((?:{self.name})){re.escape(tail)}$")

    def owns(self, resource: str) -> bool:
        """`resource` is of `pattern`, its `{name}` of `name`."""
        return self._pattern.match(resource) is not None

    def socket_for(self, resource: str) -> str:
        """The socket HAMi serves for `resource`, from its name (after the last "/") whatever its domain."""
        return self.socket.replace(NAME, resource.rsplit("/", 1)[-1])

    def resource_for(self, socket: str) -> str | None:
        """The resource HAMi registers when it serves `socket`; None for a socket not of this form."""
        m = self._socket.match(socket)
        return self.pattern.replace(NAME, m.group(1)) if m else None


@dataclass(frozen=True)
class Devices:
    """The devices as the kubelet lists them and the host shows them."""

    id: str  # a whole device's ID (a regular expression, matched whole)
    folds: tuple[str, ...]  # IDs of a share of one device, folded to group 1; `{id}` is `id`
    glob: str  # the device nodes, on the host's /dev ("" when not known: no `auto` then)
    node: str  # a device's node by its minor, `{minor}` ("" for none)
    control: str  # the driver's control node ("" for none)
    driver_gpus: str  # the driver's folder of GPUs ("" for none)
    pci_vendor: str  # `0x1234`: the PCI vendor of the devices bound to vfio-pci ("" when not known)
    check: str  # what a person runs to look at a device, in a reason
    inspect: str  # the same, in full, in a fix


@dataclass(frozen=True)
class Hami:
    """HAMi's Node annotations for these devices (its registration)."""

    register: str  # the register annotation's key (`{name}`: the resource's name)
    register_format: str  # one of REGISTER_FORMATS
    register_writer: str  # one of WRITERS
    handshake: str  # the handshake annotation's key ("" when HAMi has none for these devices)
    handshake_writer: str  # one of WRITERS ("" without a handshake)
    stuck_cache: bool  # the plugin caches the annotation before its patch: one failed patch sticks
    # The plugin stamps the handshake with its register patch on a timer of its own (every 30 s): a stamp
    # that stops moving while it serves is its register loop stopped.
    stamps_on_timer: bool


@dataclass(frozen=True)
class Chart:
    """HAMi's chart: its device-plugin DaemonSet, and where the resource is set."""

    selector: str  # `key=value`: the DaemonSet's label, or its pods'
    daemonset: (
        str  # the DaemonSet's name where the selector labels only its pods ("": it labels the DaemonSet)
    )
    container: str  # the plugin's container in the DaemonSet
    namespace: str  # where the vendor's chart or manifest installs it by default
    config_volume: str  # the ConfigMap volume holding device-config.yaml ("" for none)
    resource_value: str  # dotted path into device-config.yaml to the resource(s) ("" for none)
    node_config: str  # HAMi's node configuration (config.json) in the plugin's container ("" for none)
    ports: tuple[int, ...]  # the ports the vendor's containers listen on in the pod's network
    bash: bool  # the plugin's image has bash and timeout: the exec livenessProbe runs in it
    node_label: str  # `key=value`: the node label the chart's nodeSelector picks the nodes by ("" none)
    host_network: bool  # the plugin's pod is on the host's network: no NetworkPolicy applies to it
    ports_note: str = ""  # who listens on `ports` and who reaches them, for the NetworkPolicy's comment


@dataclass(frozen=True)
class Doctor:
    """What hami-doctor reads of the plugin."""

    process: str  # the plugin's process name
    log_patterns: tuple[str, ...]  # the catalogue's sets for the plugin's log (patterns/<set>.toml)


@dataclass(frozen=True)
class VendorProfile:
    """One vendor's profile, checked. Its methods are the names it defines, read either way."""

    name: str  # the file's name: `acme` for acme.toml
    vendor: str  # in prose: `ACME`
    default: bool  # the profile of the defaults
    resources: Resources
    devices: Devices
    hami: Hami
    chart: Chart
    doctor: Doctor
    dra: tuple[tuple[str, str], ...]  # (the program a kubelet plugin's container runs, its DRA driver)
    sources: tuple[tuple[str, str], ...]  # what the code mirrors upstream besides, and where

    @cached_property
    def _id(self) -> re.Pattern[str]:
        return re.compile(f"^(?:{self.devices.id})$")

    @cached_property
    def _folds(self) -> tuple[re.Pattern[str], ...]:
        return tuple(re.compile(f.replace(ID, self.devices.id)) for f in self.devices.folds)

    def owns(self, resource: str) -> bool:
        """`resource` is one of this profile's (`acme.example/vpu` of `acme.example/{name}`)."""
        return self.resources.owns(resource)

    def socket_for(self, resource: str) -> str:
        """The socket HAMi serves for `resource`."""
        return self.resources.socket_for(resource)

    def resource_for(self, socket: str) -> str | None:
        """The resource HAMi registers when it serves `socket`; None for a socket not of this form."""
        return self.resources.resource_for(socket)

    def register_key(self, resource: str) -> str:
        """HAMi's register annotation of `resource`."""
        return self.hami.register.replace(NAME, resource.rsplit("/", 1)[-1])

    def handshake_key(self, resource: str) -> str:
        """HAMi's handshake annotation of `resource`."""
        return self.hami.handshake.replace(NAME, resource.rsplit("/", 1)[-1])

    def is_device(self, device: str) -> bool:
        """`device` is a whole device's ID (of the form devices.id, as the driver names it)."""
        return self._id.match(device) is not None

    def physical_device(self, device: str) -> str:
        """The device an ID names a share of (the first fold that matches), else the ID itself."""
        for fold in self._folds:
            m = fold.match(device)
            if m:
                return m.group(1)
        return device

    def free_port(self, taken: Iterable[int] = ()) -> int:
        """hami-sidecar's port in this vendor's pod: SIDECAR_PORT, or the next one none of the vendor's
        containers (nor `taken`) listens on."""
        used = {*self.chart.ports, *taken}
        return next(p for p in range(SIDECAR_PORT, 65536) if p not in used)

    def shown(self, pattern: str) -> str:
        """A pattern as the text shows it: `{name}` as `<name>`."""
        return pattern.replace(NAME, "<name>")

    def as_data(self) -> dict[str, Any]:
        """The profile as its file holds it (what the post-renderer's generated copy holds)."""
        tables: dict[str, Any] = {"resources": self.resources, "devices": self.devices, "hami": self.hami}
        tables |= {"chart": self.chart, "doctor": self.doctor}
        out: dict[str, Any] = {"vendor": self.vendor, "default": self.default}
        for key, table in tables.items():
            out[key] = {f.name: _plain(getattr(table, f.name)) for f in fields(table)}
        return out | {"dra": dict(self.dra), "sources": dict(self.sources)}


def sanitized(resource: str) -> str:
    """A resource's name as kube-state-metrics labels it (`resource` of kube_node_status_capacity): every
    character but a letter, a digit and `_` made `_` (SanitizeLabelName, internal/store/utils.go)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", resource)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# --- reading and checking ------------------------------------------------------------------------------


class _Table:
    """One table of a profile: its keys taken one by one, each checked; what is left is unknown."""

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise ProfileError(f"{where}: must be a table")
        self.value: dict[str, Any] = value
        self.where = where
        self.taken: set[str] = set()

    def take(self, key: str, check: Callable[[Any, str], T], default: T | None = None) -> T:
        """The value of `key`, checked; `default` (not None): the key is optional."""
        self.taken.add(key)
        if key not in self.value:
            if default is not None:
                return default
            raise ProfileError(f"{self.where} {key}: missing")
        return check(self.value[key], f"{self.where} {key}")

    def table(self, key: str, *, optional: bool = False) -> _Table:
        """The table `key` of this one (of the file); `optional`: an empty one when absent."""
        self.taken.add(key)
        if key not in self.value and optional:
            return _Table({}, "")
        if key not in self.value:
            raise ProfileError(f"{self.where} [{key}]: missing")
        return _Table(self.value[key], f"{self.where} [{key}]")

    def pairs(
        self, key: Callable[[str, str], str], value: Callable[[Any, str], str]
    ) -> tuple[tuple[str, str], ...]:
        """Every key of the table and its value, each checked."""
        self.taken.update(self.value)
        at = self.where
        return tuple((key(k, f"{at} {k}"), value(v, f"{at} {k}")) for k, v in self.value.items())

    def done(self) -> None:
        unknown = sorted(set(self.value) - self.taken)
        if unknown:
            raise ProfileError(
                f"{self.where} unknown key {', '.join(unknown)} (known: {', '.join(sorted(self.taken))})"
            )


def _text(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{at}: must be a non-empty string")
    if value != value.strip() or any(not c.isprintable() for c in value):
        raise ProfileError(f"{at}: must be one line without leading or trailing spaces")
    return value


def _maybe(check: Callable[[Any, str], str]) -> Callable[[Any, str], str]:
    """`check`, or "" (none)."""
    return lambda value, at: "" if value == "" else check(value, at)


def _flag(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise ProfileError(f"{at}: must be true or false")
    return value


def _form(expression: re.Pattern[str], what: str) -> Callable[[Any, str], str]:
    def check(value: Any, at: str) -> str:
        text = _text(value, at)
        if not expression.match(text):
            raise ProfileError(f"{at}: {text!r} is not {what}")
        return text

    return check


def _one_of(choices: Iterable[str]) -> Callable[[Any, str], str]:
    known = tuple(choices)

    def check(value: Any, at: str) -> str:
        text = _text(value, at)
        if text not in known:
            raise ProfileError(f"{at}: {text!r} is not one of {', '.join(known)}")
        return text

    return check


def _holds(placeholder: str, *, slash: bool) -> Callable[[Any, str], str]:
    """A pattern holding `placeholder` once; `slash`: after a domain and a "/" (else no "/" at all)."""

    def check(value: Any, at: str) -> str:
        text = _text(value, at)
        if text.count(placeholder) != 1 or any(c.isspace() for c in text):
            raise ProfileError(f"{at}: {text!r} must hold {placeholder} once, and no space")
        head = text.partition(placeholder)[0]
        if slash and not re.match(rf"^{_DOMAIN}/$", head):
            raise ProfileError(
                f"{at}: {text!r} must be <domain>/ then {placeholder} (vendor.example/{{name}})"
            )
        if not slash and "/" in text:
            raise ProfileError(f"{at}: {text!r} is a file name: no /")
        return text

    return check


def _annotation(value: Any, at: str) -> str:
    """An annotation key `<domain>/<name>`, `{name}` in it standing for a resource's name."""
    text = _text(value, at)
    if not _KEY.match(text.replace(NAME, "x")):
        raise ProfileError(f"{at}: {text!r} is not an annotation key (<domain>/<name>)")
    return text


def _expression(value: Any, at: str) -> str:
    text = _text(value, at)
    try:
        re.compile(text)
    except re.error as e:
        raise ProfileError(f"{at}: not a regular expression ({e})") from None
    return text


def _folds(device_id: str) -> Callable[[Any, str], tuple[str, ...]]:
    def check(value: Any, at: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise ProfileError(f"{at}: must be a list of regular expressions")
        out = []
        for i, item in enumerate(value):
            text = _text(item, f"{at}[{i}]")
            try:
                groups = re.compile(text.replace(ID, device_id)).groups
            except re.error as e:
                raise ProfileError(f"{at}[{i}]: not a regular expression ({e})") from None
            if groups != 1:
                raise ProfileError(f"{at}[{i}]: must have one group, the device it folds to (has {groups})")
            out.append(text)
        return tuple(out)

    return check


def _names(value: Any, at: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise ProfileError(f"{at}: must be a list of names")
    return tuple(_form(_WORD, "a lowercase name")(item, f"{at}[{i}]") for i, item in enumerate(value))


def _program(text: str, at: str) -> str:
    """A program's name: a key of [dra]."""
    if not _PROGRAM.match(text):
        raise ProfileError(f"{at}: {text!r} is not a program's name")
    return text


def load(text: str, name: str, pattern_sets: Iterable[str] = ()) -> VendorProfile:
    """The profile `name` in `text` (TOML), every field checked; `pattern_sets` are the doctor's sets that
    exist. Raises ProfileError naming the file and the field."""
    source = f"{name}{SUFFIX}"
    if not _WORD.match(name):
        raise ProfileError(f"{source}: a profile's file name is a lowercase name (acme.toml)")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{source}: not valid TOML: {e}") from None
    top = _Table(doc, f"{source}:")
    vendor = top.take("vendor", _text)
    default = top.take("default", _flag)
    resources_ = _resources(top.table("resources"))
    devices = _devices(top.table("devices"))
    hami = _hami(top.table("hami"))
    chart = _chart(top.table("chart"))
    doctor = _doctor(top.table("doctor"), set(pattern_sets))
    driver = _form(re.compile(rf"^{_DOMAIN}$"), "a DRA driver's name")
    dra = top.table("dra", optional=True).pairs(_program, driver)
    sources = top.table("sources", optional=True).pairs(lambda k, _: k, _text)
    top.done()
    return VendorProfile(name, vendor, default, resources_, devices, hami, chart, doctor, dra, sources)


def _resources(t: _Table) -> Resources:
    out = Resources(
        t.take("pattern", _holds(NAME, slash=True)),
        t.take("default", _text),
        t.take("socket", _holds(NAME, slash=False)),
        t.take(
            "capacity", _form(re.compile(r'^[^"\\]+$'), "a regular expression without quotes or backslashes")
        ),
        t.take("name", _expression, NAME_EXPRESSION),
        t.take("per_node", _flag, False),
    )
    t.done()
    if not out.owns(out.default):
        raise ProfileError(
            f"{t.where} default: {out.default!r} is not of {out.pattern!r} ({{name}}: {out.name})"
        )
    _expression(out.capacity, f"{t.where} capacity")
    if not re.fullmatch(out.capacity, sanitized(out.default)):
        raise ProfileError(
            f"{t.where} capacity: {out.capacity!r} does not match {sanitized(out.default)!r}, "
            f"kube-state-metrics' name of {out.default!r}"
        )
    return out


def _devices(t: _Table) -> Devices:
    device_id = t.take("id", _expression)
    out = Devices(
        device_id,
        t.take("folds", _folds(device_id)),
        t.take("glob", _maybe(_form(re.compile(r"^/\S*[*?\[]\S*$"), "an absolute glob (/dev/acme[0-9]*)"))),
        t.take("node", _maybe(_holds(MINOR, slash=False))),
        t.take("control", _maybe(_form(re.compile(r"^[^/\s]+$"), "a file name"))),
        t.take("driver_gpus", _maybe(_form(re.compile(r"^/\S+$"), "an absolute path"))),
        t.take("pci_vendor", _maybe(_form(_PCI_VENDOR, "a PCI vendor ID as sysfs shows it (0x1234)"))),
        t.take("check", _text),
        t.take("inspect", _text),
    )
    t.done()
    if out.driver_gpus and not out.node:
        raise ProfileError(f"{t.where} node: missing for driver_gpus {out.driver_gpus!r} (its GPUs' nodes)")
    return out


def _hami(t: _Table) -> Hami:
    out = Hami(
        t.take("register", _annotation),
        t.take("register_format", _one_of(REGISTER_FORMATS)),
        t.take("register_writer", _one_of(WRITERS)),
        t.take("handshake", _maybe(_annotation)),
        t.take("handshake_writer", _maybe(_one_of(WRITERS))),
        t.take("stuck_cache", _flag),
        t.take("stamps_on_timer", _flag),
    )
    t.done()
    if bool(out.handshake) != bool(out.handshake_writer):
        raise ProfileError(f"{t.where} handshake_writer: a writer for a handshake, and none without one")
    if out.stamps_on_timer and out.handshake_writer not in ("device-plugin", "both"):
        raise ProfileError(f"{t.where} stamps_on_timer: only a plugin that writes the handshake stamps it")
    return out


def _chart(t: _Table) -> Chart:
    name = _form(_WORD, "a Kubernetes name (a DNS label)")
    out = Chart(
        t.take("selector", _form(_LABEL, "a label selector key=value")),
        t.take(
            "daemonset", _maybe(_form(re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$"), "a DaemonSet's name"))
        ),
        t.take("container", name),
        t.take("namespace", name),
        t.take("config_volume", _maybe(name)),
        t.take("resource_value", _maybe(_form(_DOTTED, "a dotted path (acme.resourceName)"))),
        t.take("node_config", _maybe(_form(re.compile(r"^/\S+$"), "an absolute path"))),
        t.take("ports", _ports),
        t.take("bash", _flag),
        t.take("node_label", _maybe(_form(_LABEL, "a node label key=value"))),
        t.take("host_network", _flag),
        t.take("ports_note", _text, ""),
    )
    t.done()
    if bool(out.config_volume) != bool(out.resource_value):
        raise ProfileError(f"{t.where} resource_value: set with config_volume, or neither")
    return out


def _doctor(t: _Table, known: set[str]) -> Doctor:
    out = Doctor(t.take("process", _form(_PROGRAM, "a process name")), t.take("log_patterns", _names))
    for i, s in enumerate(out.log_patterns):
        if s not in known:
            raise ProfileError(f"{t.where} log_patterns[{i}]: {s!r} names no set ({PATTERNS}/{s}{SUFFIX})")
    t.done()
    return out


def _ports(value: Any, at: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(
        isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536 for v in value
    ):
        raise ProfileError(f"{at}: must be a list of ports (1 to 65535)")
    return tuple(value)


def load_all(files: Mapping[str, str], pattern_sets: Iterable[str] = ()) -> tuple[VendorProfile, ...]:
    """Every profile of `files` (name: TOML text), checked each and together: exactly one is the default
    (it comes first), and no two own the same resources."""
    sets = tuple(pattern_sets)
    profiles = [load(text, name, sets) for name, text in sorted(files.items())]
    defaults = [p.name for p in profiles if p.default]
    if len(defaults) != 1:
        which = ", ".join(f"{d}{SUFFIX}" for d in defaults) if defaults else "none"
        raise ProfileError(f"exactly one profile must be the default (default = true): {which}")
    for i, p in enumerate(profiles):
        for q in profiles[i + 1 :]:
            for a, b in ((p, q), (q, p)):
                if a.owns(b.resources.default):
                    raise ProfileError(
                        f"{b.name}{SUFFIX} [resources] default: {b.resources.default!r} is also of "
                        f"{a.name}{SUFFIX} ({a.resources.pattern!r})"
                    )
                if re.fullmatch(a.resources.capacity, sanitized(b.resources.default)):
                    raise ProfileError(
                        f"{a.name}{SUFFIX} [resources] capacity: {a.resources.capacity!r} matches "
                        f"{sanitized(b.resources.default)!r}, {b.name}{SUFFIX}'s default resource"
                    )
    return tuple(sorted(profiles, key=lambda p: not p.default))


def read() -> tuple[VendorProfile, ...]:
    """The profiles shipped with the package."""
    folder = resources.files(__name__)
    sets = [f.name[: -len(SUFFIX)] for f in folder.joinpath(PATTERNS).iterdir() if f.name.endswith(SUFFIX)]
    files = {
        f.name[: -len(SUFFIX)]: f.read_text(encoding="utf-8")
        for f in folder.iterdir()
        if f.name.endswith(SUFFIX) and f.is_file()
    }
    return load_all(files, sets)


def pattern_set(name: str) -> str:
    """The text of the doctor's log-pattern set `name` (patterns/<name>.toml)."""
    return resources.files(__name__).joinpath(PATTERNS, f"{name}{SUFFIX}").read_text(encoding="utf-8")


def named(name: str) -> VendorProfile | None:
    """The profile of that name (its file's: `acme` for acme.toml), if any."""
    return next((p for p in PROFILES if p.name == name), None)


def for_resource(resource: str) -> VendorProfile | None:
    """The profile that owns `resource`, if any."""
    return next((p for p in PROFILES if p.owns(resource)), None)


def for_socket(socket: str) -> tuple[VendorProfile, str] | None:
    """The profile whose socket `socket` is, and the resource HAMi registers with it."""
    for p in PROFILES:
        resource = p.resource_for(socket)
        if resource is not None:
            return p, resource
    return None


def export(profiles: Iterable[VendorProfile]) -> str:
    """The profiles as JSON: the post-renderer's copy, manifests/hami-patch/profiles.json (`make profiles`),
    which cannot import this package; tests/test_profiles.py checks that it is current."""
    doc = {
        "generated": "by make profiles from hami_guard/profiles/*.toml: edit those, not this",
        "profiles": {p.name: p.as_data() for p in profiles},
    }
    return json.dumps(doc, indent=2) + "\n"


PROFILES = read()
DEFAULT = PROFILES[0]
