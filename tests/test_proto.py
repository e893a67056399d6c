"""The project's .proto files are wire-compatible with the kubelet's, and the generated code is current."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.message import Message

from sidecar.proto import deviceplugin_v1beta1_pb2, podresources_v1_pb2
from sidecar.rpc import DEVICE_PLUGIN, POD_RESOURCES, REGISTRATION, method_path

ROOT = Path(__file__).resolve().parent.parent
VECTORS = json.loads((Path(__file__).parent / "data" / "kubelet-wire-vectors.json").read_text())
assert deviceplugin_v1beta1_pb2 and podresources_v1_pb2  # loaded into the default pool


def message_class(full_name: str) -> type[Message]:
    descriptor = descriptor_pool.Default().FindMessageTypeByName(full_name)
    return message_factory.GetMessageClass(descriptor)


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["message"])
def test_vector_encodes_to_the_kubelets_bytes(vector: dict[str, Any]) -> None:
    msg = json_format.ParseDict(vector["fields"], message_class(vector["message"])())
    assert msg.SerializeToString(deterministic=True).hex() == vector["hex"]


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["message"])
def test_vector_decodes_to_the_same_fields(vector: dict[str, Any]) -> None:
    cls = message_class(vector["message"])
    decoded = cls.FromString(bytes.fromhex(vector["hex"]))
    expected = json_format.ParseDict(vector["fields"], cls())
    assert decoded == expected
    # Field by field, with defaults printed, so a renamed or renumbered field cannot hide.
    as_dict = json_format.MessageToDict(
        decoded, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    assert as_dict == json_format.MessageToDict(
        expected, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    assert _leaf_keys(vector["fields"]) <= _leaf_keys(as_dict)


def _leaf_keys(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        return {k for key, v in value.items() for k in _leaf_keys(v, f"{prefix}.{key}")} | {prefix}
    if isinstance(value, list):
        return {k for v in value for k in _leaf_keys(v, f"{prefix}[]")} | {prefix}
    return {prefix}


def test_every_method_path_is_the_kubelets() -> None:
    services = [REGISTRATION, DEVICE_PLUGIN, POD_RESOURCES]
    ours = {m.name: method_path(s, m.name) for s in services for m in s.methods}
    assert ours == VECTORS["method_paths"]


def test_generated_code_is_current(tmp_path: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "sidecar" / "proto").glob("*.proto"))
    assert len(protos) == 4
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted(p for p in (tmp_path / "sidecar" / "proto").iterdir())
    assert [p.name for p in generated] == sorted(
        p.name for p in (ROOT / "sidecar" / "proto").iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi"))
    )
    stale = [
        p.name for p in generated if not filecmp.cmp(p, ROOT / "sidecar" / "proto" / p.name, shallow=False)
    ]
    assert not stale, f"generated code differs from the .proto files; run `make proto`: {stale}"
    assert os.path.getsize(ROOT / "sidecar" / "proto" / "deviceplugin_v1beta1_pb2.py") > 0
