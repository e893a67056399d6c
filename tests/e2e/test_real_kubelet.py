"""The sidecar judged against the kubelet's real device manager, at both fixture releases.

The kubelet is `k8s.io/kubernetes`'s own `ManagerImpl` and PodResources server (tests/realkubelet,
docs/real-kubelet.md); the plugins are the fixture's, on the kubelet's `pluginapi` types. The truth
a verdict is compared with comes from them: an open ListAndWatch stream seen from the plugin's side,
and the allocatable count of the kubelet's `GetCapacity`. Without the fixture the tests skip; under
CI=true they fail.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import pytest

from hami_guard.flags import DeviceExpectation
from sidecar.server.status import status_document
from testing import netns
from testing.realkubelet import RealPlugin, disconnected_log, fast_takeover, has_pr_135437
from tests.conftest import wait_for
from tests.e2e.conftest import Watch
from tests.e2e.realnode import GPU, UUIDS, RealNode, restarts_seen
from tests.test_doctor import Doctor, row

# The doctor's kubelet lookup by process name would find whichever `kubelet` another test runs at the
# time (tests/test_doctor.py checks the lookup under the process-table lock): here it looks for none.
NO_PROCESS_LOOKUP = ("--kubelet-process-name", "hami-test-no-such-kubelet")


async def says(node: RealNode, why: str) -> None:
    """What the metrics and hami-doctor say of a plugin the kubelet does not hold: the same thing."""
    text = (await node.get("/metrics"))[1]
    labels = f'plugin="hami",resource="{GPU}"'
    assert f'device_plugin_check_fails_liveness{{check="registered",{labels}}} 1.0' in text
    tmp = os.path.dirname(node.dir)
    logs = [os.path.join(tmp, name) for name in ("kubelet.log", "plugin.log")]
    for log in logs:
        open(log, "a").close()
    code, doc = await Doctor(node.dir, tmp, *logs).report(*NO_PROCESS_LOOKUP)
    assert (code, doc["most_likely"]) == (1, "plugin-not-registered")
    assert why in " ".join(row(doc, "plugin-not-registered")["evidence"])


async def applied(node: RealNode, plugin: RealPlugin, generation: int | None) -> list[tuple[int, int]]:
    """Wait until `plugin` has sent its list `generation` and the kubelet has applied every list the
    plugin sent; those lists, (devices, healthy) each. The kubelet applies them one by one, a
    checkpoint write each, and lags behind on a loaded machine: a value read from it before this
    can be any earlier list's. Counted from each process's start (one kubelet, one stream)."""
    assert generation is not None
    await plugin.wait_event("sent", lambda e: e["generation"] == generation, timeout=30)
    sent = [(e["devices"], e["healthy"]) for e in plugin.process.find("sent")]
    await wait_for(
        lambda: len(node.kubelet.lists_processed(GPU)) >= len(sent),
        timeout=30,
        what=f"the kubelet to apply the {len(sent)} lists the plugin sent",
    )
    return sent


async def test_a_held_plugin_is_registered_and_a_numa_spanning_device_counts_once(node_factory: Any) -> None:
    async with node_factory(expect_devices=DeviceExpectation.at_least(2)) as node:
        await node.plugin(devices=["GPU-0@0", "GPU-1@0,1"])  # GPU-1 spans two NUMA nodes
        await node.until("/readyz", 200)
        assert node.sidecar.judge.devices()[GPU]["pod_resources"] == 2
        doc = status_document(node.sidecar)
        assert doc["kubelet_connections_from"] == "this network namespace (sock_diag)"
        assert "holds a connection" in doc["checks"][f"registered:{GPU}"]["reason"]


@pytest.mark.parametrize("graceful", [False, True], ids=["killed", "stopped"])
async def test_a_kubelet_restart_with_reregistration_never_fails_liveness(
    node_factory: Any, graceful: bool
) -> None:
    async with node_factory() as node:
        plugin = await node.plugin()  # watches kubelet.sock and registers again, as HAMi does
        await node.until("/readyz", 200)
        watch = Watch(node, "/healthz", pause=0.005)
        try:
            for i in range(3):
                mark = plugin.mark()
                await node.kubelet.restart(unlink_socket=graceful)
                await plugin.wait_event("stream-open", after=mark)
                await wait_for(partial(restarts_seen, node, i + 1), what="the restart seen")
                # Registered again in the sidecar's eyes (its cycle closed), not merely ready from before.
                await wait_for(lambda: node.sidecar.judge.history[-1].outcome == "registered")
                await node.until("/readyz", 200)
        finally:
            answers = await watch.stop()
        assert answers
        assert set(answers) == {200}
        assert node.sidecar.judge.kubelet_restarts == 3


async def test_a_kubelet_restart_without_reregistration_fails_liveness_and_a_plugin_restart_mends_it(
    node_factory: Any,
) -> None:
    async with node_factory() as node:
        plugin = await node.plugin(watch_kubelet=False)  # misses kubelet.sock's creation
        await node.until("/readyz", 200)
        await node.kubelet.restart()
        assert await plugin.streams_open() == 0  # the truth: nothing holds it
        took = await node.until("/healthz?verbose", 503, contains="holds no connection")
        assert took <= node.settings.registration_grace + node.settings.probe_interval + 1
        assert (await node.kubelet.capacity())["allocatable"].get(GPU, 0) == 0
        mark = plugin.mark()
        assert await plugin.restart()
        await plugin.wait_event("stream-open", after=mark)
        await node.until("/readyz", 200)


async def test_zero_and_all_unhealthy_devices_are_registered_by_the_real_kubelet(node_factory: Any) -> None:
    async with node_factory(expect_devices=DeviceExpectation.at_least(2)) as node:
        plugin = await node.plugin()
        await node.until("/readyz", 200)
        generation = None
        for device in ("GPU-0", "GPU-1"):
            generation = await plugin.set_health(device, False)
        # /readyz fails at the first list already (one healthy, two expected): the kubelet's own
        # count tells when it has applied the second.
        assert (await applied(node, plugin, generation))[-1] == (2, 0)
        await node.until("/readyz?verbose", 503, contains=f"[!]devices:{GPU} failed")
        await node.rounds()
        assert await plugin.streams_open() == 1
        assert (await node.kubelet.capacity())["allocatable"] == {GPU: 0}
        assert (await node.get("/healthz"))[0] == 200
        assert node.sidecar.state.checks[f"registered:{GPU}"].status.value == "ok"
        await plugin.set_devices([])
        await node.rounds()
        assert (await node.get("/healthz"))[0] == 200
        assert node.sidecar.state.checks[f"registered:{GPU}"].status.value == "ok"


async def test_hami_split_ids_count_per_gpu_against_the_real_kubelet(node_factory: Any) -> None:
    async with node_factory(expect_devices=DeviceExpectation.at_least(2)) as node:
        plugin = await node.plugin(devices=[f"{u}-{n}" for u in UUIDS for n in range(10)])
        await node.until("/readyz", 200)
        assert (await node.kubelet.capacity())["allocatable"] == {GPU: 20}
        for n in range(10):
            await plugin.set_health(f"{UUIDS[1]}-{n}", False)
        await node.until("/readyz?verbose", 503, contains="lists 1 healthy device(s) by pod-resources")
        assert (await node.get("/healthz"))[0] == 200


async def test_rapid_health_updates_keep_the_fixture_plugins_stream(node_factory: Any) -> None:
    """The fixture's plugin sends each list while later updates arrive: every list must reach the
    kubelet whole. A list changed while gRPC marshals it reaches the kubelet as bytes it cannot
    parse: it ends the stream and drops the plugin for real, and the sidecar rightly fails liveness.

    The kubelet applies the lists one by one, a checkpoint write each, and lags behind the plugin
    on a loaded machine. The last list equals the first (all healthy), so no value read from the
    kubelet tells done from not yet started: the test counts the lists instead, the plugin's sent
    against the kubelet's applied."""
    async with node_factory(expect_devices=DeviceExpectation.at_least(2)) as node:
        ids = [f"{u}-{n}" for u in UUIDS for n in range(10)]
        plugin = await node.plugin(devices=ids)
        await node.until("/readyz", 200)
        kubelet_mark, plugin_mark = node.kubelet.mark(), plugin.mark()
        generation = None
        for healthy in (False, True) * 2:
            for i in ids:
                generation = await plugin.set_health(i, healthy)
        assert generation == 4 * len(ids)
        sent = await applied(node, plugin, generation)
        assert sent[-1] == (20, 20)
        assert node.kubelet.lists_processed(GPU) == sent  # none lost, none merged, each whole
        assert (await node.kubelet.capacity())["allocatable"] == {GPU: 20}
        await node.rounds()
        assert plugin.process.find("stream-closed", after=plugin_mark) == []
        ended = "ListAndWatch ended unexpectedly for device plugin"
        assert node.kubelet.process.find("log", lambda e: e.get("msg") == ended, after=kubelet_mark) == []
        assert await plugin.streams_open() == 1
        assert node.kubelet.lists_processed(GPU) == sent
        assert (await node.kubelet.capacity())["allocatable"] == {GPU: 20}
        assert (await node.get("/healthz"))[0] == 200


async def test_issue_121994_on_the_old_release_is_a_drop_the_sidecar_names(node_factory: Any) -> None:
    """A registered, B registers on the same socket path, A's stream ends: the old kubelet disconnects B.

    On the new release (PR 135437) B is refused while A's endpoint holds the path, and A's end leaves
    an endpoint with no stream at all: not held either way, so the sidecar fails both, differently
    (the new release's readiness only: a plugin restart is refused the same way).
    """
    async with node_factory(refusal_confirm=2.0) as node:
        a = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        b = await node.plugin(devices=("GPU-0", "GPU-1", "GPU-2"), watch_kubelet=False, register=False)
        registered = await b.register()  # B binds the same path (A's file is replaced), then registers
        await node.rounds()
        if not has_pr_135437(node.release):
            assert registered
            await node.until("/readyz", 200)
            fault = time.monotonic()
            kmark = node.kubelet.mark()
            await a.crash(remove_socket=True)  # only removes the file while it is still A's: it is B's
            await b.wait_event("stream-closed")
            assert await b.streams_open() == 0
            # Disconnect (client.go) closes B's connection, then PluginDisconnected marks its devices.
            await node.kubelet.wait_log(disconnected_log(node.release), after=kmark)
            assert (await node.kubelet.capacity())["allocatable"] == {GPU: 0}
            await node.until("/healthz?verbose", 503, contains="no longer connected")
            took = time.monotonic() - fault
            limit = node.settings.probe_interval + node.settings.probe_timeout + node.settings.drop_confirm
            assert took <= limit + 1.0
            print(f"121994 on {node.kubelet.version}: the drop failed liveness {took:.3f} s after A's end")
            # The kubelet closes B's connection a moment after B's stream: the doctor may still see it
            # open, and then names the drop by pod-resources instead. Either way, a drop.
            await says(node, "dropped the plugin")
        else:
            assert not registered
            assert "device plugin already connected" in (b.last_register_error or "")
            await a.crash(remove_socket=True)
            # The refused Register's dial stays open: connected, but no device list recorded since, and
            # A's endpoint stays with no stream (its end went unnoticed): the stale-endpoint trap, which
            # only a kubelet restart mends. Not ready, never a liveness 503.
            await node.until("/readyz?verbose", 503, contains="with no stream of this socket behind them")
            assert await b.streams_open() == 0
            assert (await node.get("/healthz"))[0] == 200
        # A plugin restart is the remedy on the old release; the budget bounds it on the new one.
        if not has_pr_135437(node.release):
            mark = b.mark()
            assert await b.restart()
            await b.wait_event("stream-open", after=mark)
            await node.until("/readyz", 200)


# PR 139338's state needs PR 135437's per-path endpoints: the new release only.
@pytest.mark.parametrize("release", ["new"], indirect=True)
async def test_pr_139338_takeover_on_the_new_release(node_factory: Any) -> None:
    """The path's new owner serves the stale endpoint's stream: held. Its second Register is refused and
    the kubelet forgets its client: still held, `kubelet-client:` fails readiness. When its server
    restarts, the kubelet keeps the endpoint with no stream and refuses every Register: not held, phantom
    capacity, readiness only; never a liveness 503, no plugin restart asked (a kubelet restart is the
    remedy)."""
    async with node_factory(registration_grace=0.5, refusal_confirm=2.0) as node:
        first, second = await fast_takeover(
            node.dir, release="new", second_devices=("GPU-0", "GPU-1", "GPU-2")
        )
        node.plugins += [first, second]
        await node.until("/readyz", 200)  # the stream runs on the owner's server: held
        assert await second.streams_open() == 1
        assert not await second.register()  # refused: the kubelet forgets the stale endpoint's client
        # Its stream still runs on the owner's server, but its end would go unnoticed and the path is
        # refused until the kubelet restarts: registered, not ready, and no plugin restart asked for.
        await node.until("/readyz?verbose", 503, contains="refused that Register")
        body = (await node.get("/readyz?verbose"))[1]
        assert f"[+]registered:{GPU} ok" in body and f"[!]kubelet-client:{GPU} failed" in body, body
        assert (await node.get("/healthz"))[0] == 200
        fault = time.monotonic()
        mark = node.kubelet.mark()
        await second.restart_server_only()  # a new server: the stale endpoint's stream ends
        # The kubelet has seen that end before the Register: a Register at once races it (the end's
        # lookup by path can find the new client and disconnect it, which frees the path).
        await node.kubelet.wait_log("ListAndWatch ended unexpectedly for device plugin", after=mark)
        await node.kubelet.capacity()  # a round trip: runClient has finished with the end by now
        assert not await second.register()  # refused ("already connected")
        await node.until("/readyz?verbose", 503, contains="with no stream of this socket behind them")
        took = time.monotonic() - fault
        print(f"PR 139338 state on {node.kubelet.version}: the trap named {took:.3f} s after the restart")
        # The metrics and hami-doctor say the same: not registered, no restart, restart the kubelet.
        text = (await node.get("/metrics"))[1]
        labels = f'plugin="hami",resource="{GPU}"'
        assert f'device_plugin_check_fails_liveness{{check="registered",{labels}}} 0.0' in text
        assert f'device_plugin_check_up{{check="kubelet-client",{labels}}} 0.0' in text
        tmp = os.path.dirname(node.dir)
        open(os.path.join(tmp, "plugin.log"), "a").close()
        doctor = Doctor(node.dir, tmp, node.kubelet.process.log_path, os.path.join(tmp, "plugin.log"))
        code, doc = await doctor.report(*NO_PROCESS_LOOKUP)
        assert (code, doc["most_likely"]) == (1, "plugin-not-registered")
        found = row(doc, "plugin-not-registered")
        assert "with no stream of this socket behind them" in " ".join(found["evidence"]), found
        assert "$ systemctl restart kubelet" in found["fix"]
        assert (await node.kubelet.capacity())["allocatable"] == {GPU: 3}  # a ghost: allocatable, no stream
        for _ in range(6):  # well past the grace: a plugin restart would be refused, none is asked for
            await node.rounds(1)
            assert (await node.get("/healthz"))[0] == 200
        assert node.sidecar.state.checks[f"registered:{GPU}"].status.value == "failed"
        assert f"[!]kubelet-client:{GPU} failed" in (await node.get("/readyz?verbose"))[1]
        await node.kubelet.restart()  # the remedy
        mark = second.mark()
        assert await second.restart()
        await second.wait_event("stream-open", after=mark)
        await node.until("/readyz", 200)
        assert '"restart_budget_spent": false' in (await node.get("/status"))[1]


async def test_from_a_pod_network_namespace_the_kubelets_connections_and_a_competing_plugin(
    node_factory: Any,
) -> None:
    """The layout of a pod without hostNetwork: the kubelet's connections to the plugin live in the
    kubelet's network namespace (the connecting side's), read through /proc/<pid>/net/unix; and a
    second device plugin that re-binds the socket from a namespace of its own is named, not restarted."""
    netns.require()
    async with node_factory(kubelet_netns=True) as node:
        await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        source = status_document(node.sidecar)["kubelet_connections_from"]
        assert source.startswith("the kubelet's network namespace (/proc/"), source
        await node.kubelet.restart()  # the plugin misses it: the new kubelet's namespace, no connection
        await node.until("/healthz?verbose", 503, contains="holds no connection")
        with netns.Netns() as other:
            theirs = netns.PluginProcess.start(other, node.dir, devices=["GPU-7"])
            try:
                await node.until("/readyz?verbose", 503, contains="another device plugin serves")
                body = (await node.get("/readyz?verbose"))[1]
                assert f"[!]plugin:{GPU} failed (no restart" in body
                assert (await node.get(f"/healthz/plugin:{GPU}"))[0] == 200  # not a restart's remedy
            finally:
                theirs.stop()


async def test_from_a_pod_network_namespace_a_drop_is_judged_between_rounds(node_factory: Any) -> None:
    """HAMi's layout (the kubelet's namespace another, read through /proc/<pid>/net/unix): the kubelet's
    connection closing is seen by the read between rounds, long before the next probe round (60 s)."""
    netns.require()
    async with node_factory(kubelet_netns=True, probe_interval=60.0) as node:
        plugin = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        source = status_document(node.sidecar)["kubelet_connections_from"]
        assert source.startswith("the kubelet's network namespace (/proc/"), source
        await plugin.end_stream("oldest")
        took = await node.until("/healthz?verbose", 503, contains="no longer connected", timeout=30)
        print(f"drop read through /proc on {node.kubelet.version}: 503 after {took:.3f} s, rounds 60 s apart")


async def test_a_second_register_on_its_own_socket_then_the_first_stream_ends(node_factory: Any) -> None:
    """A connection is not a stream. The plugin registers twice on its own socket, then ends its first
    ListAndWatch stream while its server keeps serving; the kubelet keeps a connection with no stream.

    Old release: the second Register replaces the client; the first stream's end disconnects the
    second (the newest connection closes, the first's stays, pod-resources lists nothing): a drop,
    which a plugin restart mends. New release: the second Register is refused ("already connected")
    and both clients are forgotten; the first stream's end changes nothing the kubelet shows, and
    every Register at the path is refused until the kubelet restarts: readiness only.
    """
    async with node_factory(refusal_confirm=2.0) as node:
        plugin = await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        await node.rounds()
        mark = plugin.mark()
        registered = time.monotonic()
        accepted = await plugin.register()
        if not has_pr_135437(node.release):
            assert accepted
            await plugin.wait_event("stream-open", after=mark)
            assert await plugin.streams_open() == 2
            await node.rounds(3)
            assert (await node.get("/readyz"))[0] == 200  # the second stream carries the registration
        else:
            assert not accepted
            assert "device plugin already connected" in (plugin.last_register_error or "")
            # Refused: the first stream still runs (registered), but the kubelet forgot its client.
            await node.until("/readyz?verbose", 503, contains="refused that Register")
            took = time.monotonic() - registered
            print(f"second Register refused on {node.kubelet.version}: readiness 503 after {took:.3f} s")
            assert node.sidecar.state.checks[f"registered:{GPU}"].status.value == "ok"
            assert (await node.get("/healthz"))[0] == 200
        fault = time.monotonic()
        await plugin.end_stream("oldest")
        if not has_pr_135437(node.release):
            await node.until("/healthz?verbose", 503, contains="carried its registration")
            took = time.monotonic() - fault
            print(f"second Register, first stream ended, on {node.kubelet.version}: 503 after {took:.3f} s")
            limit = node.settings.probe_interval + node.settings.probe_timeout + node.settings.drop_confirm
            assert took <= limit + 1.0
            assert await plugin.streams_open() == 0
            assert (await node.kubelet.capacity())["allocatable"] == {GPU: 0}
            assert node.sidecar.judge.devices()[GPU]["pod_resources"] == 0
            await says(node, "pod-resources lists no device")
            # The remedy: a plugin restart (the livenessProbe's) registers it again.
            mark = plugin.mark()
            assert await plugin.restart()
            await plugin.wait_event("stream-open", after=mark)
            await node.until("/readyz", 200)
        else:
            await plugin.wait_event("stream-closed", after=mark)
            assert await plugin.streams_open() == 0
            await node.rounds(3)
            assert (await node.kubelet.capacity())["allocatable"] == {GPU: 2}  # no stream behind it
            code, body = await node.get("/readyz?verbose")
            assert code == 503 and "refused that Register" in body, body
            assert (await node.get("/healthz"))[0] == 200  # a plugin restart would be refused too
            # hami-doctor reads the refusal in the kubelet's log, and names the kubelet restart.
            tmp = os.path.dirname(node.dir)
            open(os.path.join(tmp, "plugin.log"), "a").close()
            doctor = Doctor(node.dir, tmp, node.kubelet.process.log_path, os.path.join(tmp, "plugin.log"))
            code, doc = await doctor.report(*NO_PROCESS_LOOKUP)
            assert (code, doc["most_likely"]) == (1, "plugin-not-registered")
            found = row(doc, "plugin-not-registered")
            assert "refused a later Register" in " ".join(found["evidence"])
            assert "$ systemctl restart kubelet" in found["fix"]
            logged = row(doc, "kubelet-log")
            assert "refuses every Register at that path" in " ".join(logged["evidence"]), logged
            assert "$ systemctl restart kubelet" in logged["fix"]
            assert not await plugin.restart()
            await node.kubelet.restart()  # the remedy
            mark = plugin.mark()
            assert await plugin.restart()
            await plugin.wait_event("stream-open", after=mark)
            await node.until("/readyz", 200)


async def test_the_sidecar_reads_the_kubelets_release_from_its_binary(node_factory: Any) -> None:
    """The rules that differ between releases follow the kubelet's own binary (its Go build information):
    the fixture's names the kubernetes module it embeds."""
    async with node_factory(name_kubelet=True) as node:
        await node.plugin(watch_kubelet=False)
        await node.until("/readyz", 200)
        found = status_document(node.sidecar)["kubelet_release"]
        assert found["version"] == node.kubelet.version, found
        assert found["source"].startswith("the binary of pid"), found
        assert found["rules"] == ("1.37" if has_pr_135437(node.release) else "1.30-1.36"), found
