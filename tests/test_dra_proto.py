"""The DRA .proto files (plugin registration, DRA service) against the kubelet's own Go types.

`realdra vectors` (tests/realdra/vectors.go) marshals messages of `k8s.io/kubelet`'s generated
types at each release; the project's classes must encode the same fields to the same bytes and
decode them back, and its method paths must be the kubelet's.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.message import Message

from sidecar.dra.probes import REGISTRATION
from sidecar.proto import dra_v1_pb2, pluginregistration_v1_pb2
from sidecar.rpc import method_path
from testing.realdra import Release, fixture_binary
from tests.test_realdra import require_fixture

DRA_PLUGIN = dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"]
assert pluginregistration_v1_pb2  # loaded into the default pool


@pytest.fixture(params=["new", "old"])
def vectors(request: pytest.FixtureRequest) -> dict[str, Any]:
    release: Release = request.param
    require_fixture(release)
    binary = fixture_binary(release)
    assert binary is not None
    out = subprocess.run([str(binary), "vectors"], capture_output=True, text=True, check=True, timeout=30)
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def message_class(full_name: str) -> type[Message]:
    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(full_name))


def test_every_message_encodes_and_decodes_as_the_kubelets(vectors: dict[str, Any]) -> None:
    assert len(vectors["vectors"]) == 8
    for v in vectors["vectors"]:
        cls = message_class(v["message"])
        ours = json_format.ParseDict(v["fields"], cls())
        assert ours.SerializeToString(deterministic=True).hex() == v["hex"], v["message"]
        decoded = cls.FromString(bytes.fromhex(v["hex"]))
        assert decoded == ours, v["message"]
        as_dict = json_format.MessageToDict(decoded, preserving_proto_field_name=True)
        assert as_dict == v["fields"], v["message"]


def test_method_paths_are_the_kubelets(vectors: dict[str, Any]) -> None:
    ours = [method_path(s, m.name) for s in (REGISTRATION, DRA_PLUGIN) for m in s.methods]
    assert ours == vectors["method_paths"]
