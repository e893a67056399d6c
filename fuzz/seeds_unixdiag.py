"""Writes the seed corpora of fuzz/fuzz_sock_diag.py and fuzz/fuzz_proc_net_unix.py (fuzz/corpus/<name>/),
from the kernel of the machine it runs on:

    python -m fuzz.seeds_unixdiag     # root: a network namespace of its own (unshare --net)

In that namespace: a listener on a socket file with a connection to it, an abstract listener, and the
hostile names of tests/forged.py (a newline and a made-up line of /proc/net/unix). Each seed is what the
kernel answered: the datagrams of a sock_diag dump, the namespace's /proc/self/net/unix; and the first
lines of the machine's own /proc/net/unix (its paths replaced by paths of the same length).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from testing.netns import Netns
from tests.forged import forged_names
from tests.test_unixdiag import CAPTURE

CORPUS = Path(__file__).resolve().parent / "corpus"


def _write(name: str, seed: str, data: bytes) -> None:
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / seed).write_bytes(data)


def _capture(ns: Netns, *names: bytes) -> tuple[list[bytes], bytes]:
    argv = [sys.executable, "-c", CAPTURE, *(n.hex() for n in names)]
    done = ns.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    out = json.loads(done.stdout)
    return [bytes.fromhex(g) for g in out["grams"]], bytes.fromhex(out["table"])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hg-") as tmp, Netns() as ns:
        plugin = f"{tmp}/device-plugins/nvidia-gpu.sock"
        Path(plugin).parent.mkdir()
        kubelet = f"{tmp}/device-plugins/kubelet.sock"
        cases = {
            "plain": [plugin.encode()],
            "forged": [plugin.encode(), *forged_names(kubelet, plugin, "/var/lib/kubelet/device-plugins")],
        }
        for case, names in cases.items():
            Path(plugin).unlink(missing_ok=True)
            grams, table = _capture(ns, *names)
            for i, gram in enumerate(grams):
                _write("sock_diag", f"{case}-{i}", gram)
            _write("proc_net_unix", case, table.replace(tmp.encode(), b"/tmp/hg-abcdefgh"))
    host = Path("/proc/self/net/unix").read_bytes().splitlines(keepends=True)[:40]
    _write("proc_net_unix", "host", b"".join(_anonymous(line) for line in host))
    subprocess.run(["ls", "-l", str(CORPUS / "proc_net_unix"), str(CORPUS / "sock_diag")], check=False)


def _anonymous(line: bytes) -> bytes:
    """The line with the letters and digits of its name replaced: the same shape, no host's path."""
    m = re.match(rb"(\S+: \S+ \S+ \S+ \S+ \S+ +\d+)( .*)?(\n?)$", line, re.S)
    if m is None or m.group(2) is None:
        return line
    return m.group(1) + re.sub(rb"[A-Za-z0-9]", b"x", m.group(2)) + m.group(3)


if __name__ == "__main__":
    main()
