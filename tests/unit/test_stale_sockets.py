"""Unix sockets a killed process left behind are removed; live ones and other files are not."""

import os
import socket
import time

from process.stale_sockets import bound_unix_paths, remove_stale_sockets

PATTERNS = ("hivemind-p2pd-*.sock", "hivemind-p2pclient-*.sock")


def _dead_socket(path):
    """A socket file whose process is gone: bound, then closed without removing the file."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    return path


def _age(path, seconds):
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_only_old_sockets_nobody_listens_on_are_removed(tmp_path):
    dead = _dead_socket(tmp_path / "hivemind-p2pd-dead.sock")
    dead_client = _dead_socket(tmp_path / "hivemind-p2pclient-dead.sock")
    young = _dead_socket(tmp_path / "hivemind-p2pclient-young.sock")
    other_name = _dead_socket(tmp_path / "someone-else.sock")
    not_a_socket = tmp_path / "hivemind-p2pd-file.sock"
    not_a_socket.write_text("")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live_path = tmp_path / "hivemind-p2pd-live.sock"
    live.bind(str(live_path))
    live.listen()
    try:
        for path in (dead, dead_client, other_name, not_a_socket, live_path):
            _age(path, 600)
        removed = remove_stale_sockets(tmp_path, PATTERNS, min_age_s=60)
        assert sorted(removed) == sorted([dead, dead_client])
        assert not dead.exists() and not dead_client.exists()
        assert young.exists() and other_name.exists() and not_a_socket.exists() and live_path.exists()
        assert str(live_path) in bound_unix_paths()
    finally:
        live.close()


def test_a_missing_directory_removes_nothing(tmp_path):
    assert remove_stale_sockets(tmp_path / "absent", PATTERNS, min_age_s=0) == []


def test_without_proc_nothing_is_known_to_be_stale(tmp_path):
    assert bound_unix_paths(tmp_path / "no-proc") is None
