"""A real API server for the tests: etcd (Debian's etcd-server) and kube-apiserver from k8s.io/kubernetes
(tests/node/bin/kube-apiserver, built by `make node-bins`), on loopback ports of their own, in a
folder of their own.

Static bearer tokens (`--token-auth-file`) stand for the ServiceAccounts: `admin` (system:masters),
`slices` (a ClusterRole that may list resourceslices, bound by the test), `nobody` (no role: 403),
`hami-plugin` and `hami-sidecar` (HAMi's device plugin and the sidecar beside it: roles granted by the
test with `grant`).
The serving certificate is the one kube-apiserver generates for itself (`--cert-dir`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from testing import free_port
from tests.conftest import stop_process

BINARY = Path(__file__).resolve().parent / "node" / "bin" / "kube-apiserver"
TOKENS = {
    "admin": "admin-token",
    "slices": "slices-token",
    "nobody": "nobody-token",
    "hami-plugin": "hami-plugin-token",
    "hami-sidecar": "hami-sidecar-token",
}
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def missing() -> str | None:
    """Why a real API server cannot run here, None when it can."""
    if not BINARY.exists():
        return f"{BINARY} is not built (make node-bins)"
    for tool in ("etcd", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install etcd-server openssl)"
    return None


@dataclass
class ApiServer:
    root: str
    url: str = ""
    ca_file: str = ""
    procs: tuple[subprocess.Popen[bytes], ...] = ()

    def token_file(self, user: str) -> str:
        path = os.path.join(self.root, f"{user}.token")
        with open(path, "w") as f:
            f.write(TOKENS[user] + "\n")
        return path

    def kubeconfig(self, user: str = "admin") -> str:
        path = os.path.join(self.root, f"{user}.kubeconfig")
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "t", "cluster": {"server": self.url, "certificate-authority": self.ca_file}}
            ],
            "users": [{"name": user, "user": {"token": TOKENS[user]}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": user}}],
            "current-context": "t",
        }
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    async def start(self, timeout: float = 90.0) -> None:
        run = await asyncio.to_thread(self._launch)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self.request("GET", "/readyz", raw=True) == "ok":
                    return
            except (OSError, aiohttp.ClientError, ssl.SSLError, RuntimeError):
                pass
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"kube-apiserver not ready (logs in {run})")
            await asyncio.sleep(0.5)

    def _launch(self) -> str:
        """Keys, tokens, etcd and kube-apiserver started; the folder of their files and logs."""
        run = os.path.join(self.root, "api")
        os.makedirs(os.path.join(run, "certs"))
        key, pub = os.path.join(run, "sa.key"), os.path.join(run, "sa.pub")
        subprocess.run(["openssl", "genrsa", "-out", key, "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", key, "-pubout", "-out", pub], check=True, capture_output=True
        )
        tokens = os.path.join(run, "tokens.csv")
        with open(tokens, "w") as f:
            f.write(f"{TOKENS['admin']},admin,admin-uid,system:masters\n")
            for user, token in TOKENS.items():
                if user != "admin":
                    f.write(f"{token},{user},{user}-uid\n")
        client, peer, secure = free_port(), free_port(), free_port()
        etcd = [
            "etcd",
            "--name=t",
            f"--data-dir={run}/etcd",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=t=http://127.0.0.1:{peer}",
        ]
        api = [
            str(BINARY),
            f"--etcd-servers=http://127.0.0.1:{client}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={secure}",
            "--endpoint-reconciler-type=none",
            "--service-cluster-ip-range=10.96.0.0/16",
            f"--cert-dir={run}/certs",
            f"--token-auth-file={tokens}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={pub}",
            f"--service-account-signing-key-file={key}",
            "--authorization-mode=RBAC",
        ]
        with (
            open(os.path.join(run, "etcd.log"), "wb") as e,
            open(os.path.join(run, "apiserver.log"), "wb") as a,
        ):
            self.procs = (
                subprocess.Popen(etcd, stdout=e, stderr=e, start_new_session=True),
                subprocess.Popen(api, stdout=a, stderr=a, start_new_session=True),
            )
        self.url = f"https://127.0.0.1:{secure}"
        self.ca_file = os.path.join(run, "certs", "apiserver.crt")
        return run

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        user: str = "admin",
        raw: bool = False,
        *,
        content_type: str = "application/json",
    ) -> Any:
        ctx = ssl.create_default_context(cafile=self.ca_file) if os.path.exists(self.ca_file) else False
        headers = {"Authorization": f"Bearer {TOKENS[user]}", "Content-Type": content_type}
        data = None if body is None else json.dumps(body)
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
            s.request(method, self.url + path, data=data, headers=headers, ssl=ctx) as r,
        ):
            text = await r.text()
            if r.status >= 300:
                raise RuntimeError(f"{method} {path}: {r.status} {text[:300]}")
            return text if raw else json.loads(text)

    async def setup_node(self, node: str) -> None:
        """The Node, and the `slices` user's right to list ResourceSlices (as a ServiceAccount's would be)."""
        await self.request(
            "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
        )
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        await self.request(
            "POST",
            f"{rbac}/clusterroles",
            {
                "metadata": {"name": "resourceslice-reader"},
                "rules": [
                    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]}
                ],
            },
        )
        await self.request(
            "POST",
            f"{rbac}/clusterrolebindings",
            {
                "metadata": {"name": "resourceslice-reader"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "resourceslice-reader",
                },
                "subjects": [{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": "slices"}],
            },
        )

    async def grant(self, user: str, name: str, resources: list[str], verbs: list[str]) -> None:
        """A ClusterRole `name` with `verbs` on core `resources`, bound to `user`."""
        rule = {"apiGroups": [""], "resources": resources, "verbs": verbs}
        await self.request("POST", f"{RBAC}/clusterroles", {"metadata": {"name": name}, "rules": [rule]})
        await self.bind(user, name)

    async def bind(self, user: str, name: str) -> None:
        """Bind the ClusterRole `name` to `user` (a binding of the same name)."""
        subject = {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": user}
        role = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
        await self.request(
            "POST",
            f"{RBAC}/clusterrolebindings",
            {"metadata": {"name": name}, "roleRef": role, "subjects": [subject]},
        )

    async def unbind(self, name: str) -> None:
        """Remove the binding `name`: its user loses the role's rights."""
        await self.request("DELETE", f"{RBAC}/clusterrolebindings/{name}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop_process(p)
