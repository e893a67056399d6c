"""The catalogue of log lines (doctor/patterns.toml and the profile's sets), read and checked once, at import.

The data lives apart from its reader, as node-problem-detector keeps its rules in `config/`:
adding a line the kubelet or a plugin prints is an entry in a TOML file, and `doctor.logscan`
scans with whatever patterns it is given. doctor/patterns.toml holds what every vendor shares;
the default vendor profile names the sets that hold its plugin's lines and texts
(hami_guard/profiles/patterns/<set>.toml), read with it as one catalogue whose files share their
[shared] names; `{resource}` and `{selector}` in a text stand for the profile's default resource
and DaemonSet label. Every entry is checked here before any log is read: an unknown key, a
missing field, a row that does not exist, a reference to no shared text, a shared text nothing
uses or defined twice, an unknown placeholder, two entries that match the same words: each is a
`CatalogueError` that names the entry, so a bad catalogue stops the doctor at import, never
mid-report.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from doctor.types import TITLES, Kind, Pattern
from hami_guard import profiles
from hami_guard.profiles import VendorProfile

FILE = "patterns.toml"
# Each section of the file, and the rows its patterns may feed.
SECTIONS: Mapping[str, frozenset[str]] = {
    "kubelet": frozenset({"kubelet-log"}),
    "plugin": frozenset({"plugin-log", "driver-runtime", "hami-registration"}),
    "dra": frozenset({"dra-log"}),
}
KINDS: tuple[Kind, ...] = ("error", "attempt", "success")
REQUIRED = ("text", "cause", "meaning", "source")
OPTIONAL = ("kind", "fix", "ignore_case", "rejects", "refine")
# The shared texts the rules read by name (doctor/causes.py, doctor/dra/causes.py): a text, or lines.
NAMED: Mapping[str, type] = {
    "restart-plugin": str,
    "runtime-fix": list,
    "driver-fix": list,
    "already-connected": str,
    "restart-driver": str,
    "other-plugin-fix": list,
    "no-driver-error": str,
}
REF = "@"
PLACEHOLDER = re.compile(r"\{([a-z-]*)\}")


class CatalogueError(ValueError):
    """A bad entry of the catalogue: where it is, and what is wrong with it."""


@dataclass(frozen=True)
class Catalogue:
    """The patterns of each section, in the file's order, and the shared texts, references resolved."""

    kubelet: tuple[Pattern, ...]
    plugin: tuple[Pattern, ...]
    dra: tuple[Pattern, ...]
    texts: Mapping[str, str]  # the shared texts the rules read by name (NAMED)
    fixes: Mapping[str, tuple[str, ...]]


class _Shared:
    """The [shared] tables of the catalogue's files, as one: "@name" references resolved, placeholders
    filled, and which entries they used."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self.table: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # where each entry is defined
        self.values = values
        self.used: set[str] = set()
        self._resolving: list[str] = []

    def add(self, table: object, where: str) -> None:
        """One file's [shared] table."""
        if not isinstance(table, dict):
            raise CatalogueError(f"{where}: [shared] must be a table")
        for name, value in table.items():
            if name in self.table:
                raise CatalogueError(f"{where}: [shared] {name}: defined in {self.origin[name]} already")
            self.table[name], self.origin[name] = value, where

    def fill(self, text: str, at: str) -> str:
        """`text` with its placeholders filled."""

        def one(m: re.Match[str]) -> str:
            if m.group(1) not in self.values:
                known = ", ".join(f"{{{k}}}" for k in self.values)
                raise CatalogueError(f"{at}: {m.group(0)} is no placeholder (known: {known})")
            return self.values[m.group(1)]

        return PLACEHOLDER.sub(one, text)

    def get(self, ref: str, at: str) -> Any:
        """The resolved value `ref` ("@name") stands for."""
        name = ref[len(REF) :]
        if name not in self.table:
            raise CatalogueError(f"{at}: {ref!r} names no entry of [shared]")
        if name in self._resolving:
            raise CatalogueError(f"{at}: {ref!r} refers to itself ({' -> '.join(self._resolving)})")
        self.used.add(name)
        self._resolving.append(name)
        try:
            return self.value(self.table[name], f"{self.origin[name]}: [shared] {name}")
        finally:
            self._resolving.pop()

    def value(self, value: Any, at: str) -> Any:
        """A value with its references resolved: a list's "@name" items spliced in (or inserted)."""
        if isinstance(value, str):
            return self.get(value, at) if value.startswith(REF) else self.fill(value, at)
        if isinstance(value, list):
            out: list[Any] = []
            for i, item in enumerate(value):
                if isinstance(item, str) and item.startswith(REF):
                    found = self.get(item, f"{at}[{i}]")
                    out += found if isinstance(found, list) else [found]
                else:
                    out.append(self.value(item, f"{at}[{i}]"))
            return out
        return value  # a boolean, a number, a table: the field's own check judges it


def _text(value: Any, at: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CatalogueError(f"{at}: must be a non-empty string")
    if "\n" in value:
        raise CatalogueError(f"{at}: must be one line")
    return value


def _flag(value: Any, at: str) -> bool:
    if not isinstance(value, bool):
        raise CatalogueError(f"{at}: must be true or false")
    return value


def _lines(value: Any, at: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise CatalogueError(f"{at}: must be a list of strings")
    return tuple(_text(v, f"{at}[{i}]") for i, v in enumerate(value))


def _refine(value: Any, at: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise CatalogueError(f"{at}: must be a list of [words, meaning] pairs")
    pairs = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise CatalogueError(f"{at}[{i}]: must be a [words, meaning] pair")
        pairs.append((_text(pair[0], f"{at}[{i}] words"), _text(pair[1], f"{at}[{i}] meaning")))
    return tuple(pairs)


def _pattern(entry: Any, at: str, causes: frozenset[str], shared: _Shared) -> Pattern:
    """One entry of a section, checked."""
    if not isinstance(entry, dict):
        raise CatalogueError(f"{at}: must be a table")
    if isinstance(entry.get("text"), str):
        at = f"{at} ({entry['text']!r})"
    unknown = sorted(set(entry) - {*REQUIRED, *OPTIONAL})
    if unknown:
        raise CatalogueError(
            f"{at}: unknown key {', '.join(unknown)} (known: {', '.join(REQUIRED + OPTIONAL)})"
        )
    missing = [k for k in REQUIRED if k not in entry]
    if missing:
        raise CatalogueError(f"{at}: {', '.join(missing)} missing")
    e = {k: shared.value(v, f"{at} {k}") for k, v in entry.items()}
    cause = _text(e["cause"], f"{at} cause")
    if cause not in causes or cause not in TITLES:
        raise CatalogueError(
            f"{at} cause: {cause!r} is not a row of this section ({', '.join(sorted(causes))})"
        )
    kind = e.get("kind", "error")
    if kind not in KINDS:
        raise CatalogueError(f"{at} kind: {kind!r} is not one of {', '.join(KINDS)}")
    pattern = Pattern(
        text=_text(e["text"], f"{at} text"),
        cause=cause,
        meaning=_text(e["meaning"], f"{at} meaning"),
        fix=_lines(e.get("fix", []), f"{at} fix"),
        source=_text(e["source"], f"{at} source"),
        kind=kind,
        ignore_case=_flag(e.get("ignore_case", False), f"{at} ignore_case"),
        refine=_refine(e.get("refine", []), f"{at} refine"),
        rejects=_flag(e.get("rejects", False), f"{at} rejects"),
    )
    if pattern.rejects and pattern.kind != "error":
        raise CatalogueError(f"{at} rejects: only an error line rejects a Register")
    return pattern


def _section(
    docs: Sequence[tuple[Mapping[str, Any], str]], name: str, source: str, shared: _Shared
) -> tuple[Pattern, ...]:
    """A section's patterns from every file that has it, checked, none matching the words of another."""
    patterns: list[Pattern] = []
    for doc, where in docs:
        entries = doc.get(name, [])
        if not isinstance(entries, list):
            raise CatalogueError(f"{where}: [[{name}]] must be a list of tables")
        patterns += (
            _pattern(entry, f"{where}: [[{name}]] #{i + 1}", SECTIONS[name], shared)
            for i, entry in enumerate(entries)
        )
    if not patterns:
        raise CatalogueError(f"{source}: no [[{name}]] entry")
    seen: dict[str, str] = {}
    for p in patterns:
        key = p.text.lower()
        if key in seen:
            raise CatalogueError(f"{source}: [[{name}]] {p.text!r} matches the same words as {seen[key]!r}")
        seen[key] = p.text
    return tuple(patterns)


def load(
    text: str,
    source: str = FILE,
    sets: Sequence[tuple[str, str]] = (),
    values: Mapping[str, str] | None = None,
) -> Catalogue:
    """The catalogue in `text` (TOML) and the `sets` ((text, source) pairs) read with it, every entry
    checked, `values` filling the placeholders; a `CatalogueError` names a bad one."""
    shared = _Shared(values or {})
    docs = []
    for body, where in ((text, source), *sets):
        try:
            doc = tomllib.loads(body)
        except tomllib.TOMLDecodeError as e:
            raise CatalogueError(f"{where}: not valid TOML: {e}") from None
        unknown = sorted(set(doc) - {"shared", *SECTIONS})
        if unknown:
            raise CatalogueError(f"{where}: unknown table {', '.join(unknown)}")
        shared.add(doc.get("shared", {}), where)
        docs.append((doc, where))
    kubelet, plugin, dra = (_section(docs, name, source, shared) for name in SECTIONS)
    unused = sorted(set(shared.table) - shared.used - set(NAMED))
    if unused:
        origins = sorted({shared.origin[name] for name in unused})
        raise CatalogueError(f"{', '.join(origins)}: [shared] {', '.join(unused)}: used by no entry")
    texts: dict[str, str] = {}
    fixes: dict[str, tuple[str, ...]] = {}
    for name, kind in NAMED.items():
        at = f"{shared.origin.get(name, source)}: [shared] {name} (the rules read it)"
        if name not in shared.table:
            raise CatalogueError(f"{at}: missing")
        value = shared.value(shared.table[name], at)
        if kind is str:
            texts[name] = _text(value, at)
        else:
            fixes[name] = _lines(value, at)
    return Catalogue(kubelet, plugin, dra, texts, fixes)


def read(profile: VendorProfile = profiles.DEFAULT) -> Catalogue:
    """The catalogue shipped with the package, with the sets `profile` names."""
    sets = [
        (profiles.pattern_set(name), f"{profiles.PATTERNS}/{name}{profiles.SUFFIX}")
        for name in profile.doctor.log_patterns
    ]
    values = {
        "resource": profile.resources.default,
        "selector": profile.chart.selector,
        "namespace": profile.chart.namespace,
    }
    return load(resources.files("doctor").joinpath(FILE).read_text(encoding="utf-8"), FILE, sets, values)


# Every profile's catalogue, each read and checked at import: a bad set of any vendor stops the doctor
# here, not on the node of that vendor. The doctor reads its vendor's (`catalogue`).
CATALOGUES: Mapping[str, Catalogue] = {p.name: read(p) for p in profiles.PROFILES}


def catalogue(profile: VendorProfile | None) -> Catalogue:
    """The catalogue of `profile`'s plugin; a vendor without a profile: the shared lines and the default
    vendor's texts (its sets' lines never match another plugin's log)."""
    return CATALOGUES.get(profile.name if profile else "", CATALOGUES[profiles.DEFAULT.name])


CATALOGUE = CATALOGUES[profiles.DEFAULT.name]
KUBELET_PATTERNS = CATALOGUE.kubelet
PLUGIN_PATTERNS = CATALOGUE.plugin
DRA_PATTERNS = CATALOGUE.dra
RESTART_PLUGIN = CATALOGUE.texts["restart-plugin"]
RUNTIME_FIX = CATALOGUE.fixes["runtime-fix"]
DRIVER_FIX = CATALOGUE.fixes["driver-fix"]
# Kubernetes 1.37 (manager.go PluginConnected): an endpoint is still connected at the path.
ALREADY_CONNECTED = CATALOGUE.texts["already-connected"]
RESTART_DRIVER = CATALOGUE.texts["restart-driver"]
# Another plugin on the same socket and resource (the vendor's own operator's): turn one off.
OTHER_PLUGIN_FIX = CATALOGUE.fixes["other-plugin-fix"]
# The driver row's evidence when the plugin's log holds none of the driver's errors.
NO_DRIVER_ERROR = CATALOGUE.texts["no-driver-error"]
