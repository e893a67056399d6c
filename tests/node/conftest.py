"""The node end-to-end tests' shared fixture: HAMi's device-plugin DaemonSet with hami-guard's component,
applied once per session, healthy before the first test (tests/node/kit.py has the helpers)."""

from __future__ import annotations

import pytest

from tests.node.kit import HERE, SELECTOR, get, healthy_plugin, kubectl, set_fault, wait


@pytest.fixture(scope="session", autouse=True)
def daemonset() -> None:
    """Applies the overlay (tests/node/overlay) and waits for the plugin Ready and allocatable."""
    for fault in ("ignore-kubelet-restart", "noregister", "drop"):
        set_fault(fault, False)
    rendered = kubectl("kustomize", str(HERE / "overlay"))
    kubectl("apply", "-f", "-", stdin=rendered)
    wait("the plugin pod", lambda: get("pods", selector=SELECTOR)["items"] or None, 120)
    healthy_plugin(240)
