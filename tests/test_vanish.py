"""A deleted plugin socket whose listener the kernel still holds: the plugin did not stop."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from sidecar.deviceplugin.listeners import PluginListener, file_id, listener_of, still_listening


def listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen()
    return s


def test_thelistener_of_an_unlinked_socket_file_is_still_found_until_it_closes(tmp_path: Path) -> None:
    path = str(tmp_path / "nvidia-gpu.sock")
    listener = listen(path)
    try:
        bound = file_id(path)
        assert bound is not None
        found = PluginListener(bound, listener_of(bound))
        assert found.ino == os.fstat(listener.fileno()).st_ino
        assert still_listening(found) is True
        os.unlink(path)  # a kubelet restart's cleanup
        assert still_listening(found) is True
        # Another socket at the same path is another file: it never stands for the first.
        with listen(path):
            assert file_id(path) != bound
            listener.close()  # the plugin stopped
            assert still_listening(found) is False
    finally:
        listener.close()
    assert still_listening(None) is None
    assert still_listening(PluginListener(bound, None)) is None


def test_a_new_file_given_the_closed_listeners_inode_number_never_stands_for_it(tmp_path: Path) -> None:
    """ext4 hands a freed inode number to the next file at once: on a busy node (or beside other tests)
    the next socket bound anywhere on that filesystem may carry the stopped plugin's (st_dev, st_ino)."""
    path = str(tmp_path / "nvidia-gpu.sock")
    with listen(path) as listener:
        bound = file_id(path)
        assert bound is not None
        found = PluginListener(bound, listener_of(bound))
    os.unlink(path)
    with contextlib.ExitStack() as stack:
        for i in range(200):
            other = str(tmp_path / f"other-{i}.sock")
            stack.enter_context(listen(other))
            if file_id(other) == bound:
                break
        reused = file_id(other) == bound
        assert listener_of(bound) is not None or not reused  # the file id alone is fooled
        assert still_listening(found) is False
    assert listener.fileno() == -1
