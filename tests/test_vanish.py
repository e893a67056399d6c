"""A deleted plugin socket whose listener the kernel still holds: the plugin did not stop."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from sidecar.deviceplugin.watch import _file_id, _still_listening


def test_the_listener_of_an_unlinked_socket_file_is_still_found_until_it_closes(tmp_path: Path) -> None:
    path = str(tmp_path / "nvidia-gpu.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen()
        bound = _file_id(path)
        assert bound is not None
        assert _still_listening(bound) is True
        os.unlink(path)  # a kubelet restart's cleanup
        assert _still_listening(bound) is True
        # Another socket at the same path is another file: it never stands for the first.
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with other:
            other.bind(path)
            other.listen()
            assert _file_id(path) != bound
            listener.close()  # the plugin stopped
            assert _still_listening(bound) is False
    finally:
        listener.close()
    assert _still_listening(None) is None
