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
        found = PluginListener(bound, listener_of(bound, (path,)))
        assert found.ino == os.fstat(listener.fileno()).st_ino
        assert still_listening(found, (path,)) is True
        os.unlink(path)  # a kubelet restart's cleanup
        assert still_listening(found, (path,)) is True
        # Another socket at the same path is another file: it never stands for the first.
        with listen(path):
            assert file_id(path) != bound
            listener.close()  # the plugin stopped
            assert still_listening(found, (path,)) is False
    finally:
        listener.close()
    assert still_listening(None, (path,)) is None
    # A listener never found is asked for again by its file: none is bound to it now.
    assert still_listening(PluginListener(bound, None), (path,)) is False


def test_a_listener_bound_but_not_yet_listening_is_found_once_it_listens(tmp_path: Path) -> None:
    """Go's net.Listen binds the file (its creation event), then listens: a lookup in between finds no
    listener, and the verdict on a later removal asks again rather than keeping that "none"."""
    path = str(tmp_path / "nvidia-gpu.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        bound = file_id(path)
        assert bound is not None
        early = PluginListener(bound, listener_of(bound, (path,)))
        assert early.ino is None  # bound, not listening: no listener yet
        s.listen()
        os.unlink(path)  # someone else removes the file while the plugin listens
        assert still_listening(early, (path,)) is True
        # Under another name that file is another socket's: not this plugin's listener.
        assert still_listening(early, (str(tmp_path / "other.sock"),)) is False
    assert still_listening(early, (path,)) is False


def test_a_symbolic_link_at_the_plugins_path_is_no_socket_file(tmp_path: Path) -> None:
    other = str(tmp_path / "other.sock")
    path = str(tmp_path / "nvidia-gpu.sock")
    with listen(other):
        os.symlink(other, path)
        assert file_id(other) is not None
        assert file_id(path) is None


def test_a_new_file_given_the_closed_listeners_inode_number_never_stands_for_it(tmp_path: Path) -> None:
    """ext4 hands a freed inode number to the next file at once: on a busy node (or beside other tests)
    the next socket bound anywhere on that filesystem may carry the stopped plugin's (st_dev, st_ino)."""
    path = str(tmp_path / "nvidia-gpu.sock")
    with listen(path) as listener:
        bound = file_id(path)
        assert bound is not None
        found = PluginListener(bound, listener_of(bound, (path,)))
    os.unlink(path)
    with contextlib.ExitStack() as stack:
        for i in range(200):
            other = str(tmp_path / f"other-{i}.sock")
            stack.enter_context(listen(other))
            if file_id(other) == bound:
                break
        reused = file_id(other) == bound
        assert listener_of(bound, (other,)) is not None or not reused  # the file id alone is fooled
        assert still_listening(found, (path,)) is False
    assert listener.fileno() == -1
