"""The one durable atomic write (``_files``): what a reader sees during and after a write, the
mode, the fsyncs of the file and its directory, and the temporary files a killed writer leaves."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devplugin_sdk import _files
from devplugin_sdk._files import (
    commit,
    discard,
    remove_temporaries,
    stage,
    temporary_names,
    write_atomically,
)

OLD = b"old " * 1024
NEW = b"new " * 4096


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[os.stat_result]:
    """The status of every file descriptor os.fsync was called with, in order."""
    calls: list[os.stat_result] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        calls.append(os.fstat(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return calls


@pytest.fixture
def umask() -> Iterator[None]:
    saved = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(saved)


# ----------------------------------------------------------------------------- old or new


def test_a_reader_sees_the_old_file_until_the_new_one_replaces_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(OLD)
    old_inode = path.stat().st_ino
    seen: list[tuple[bytes, list[str]]] = []
    real_fsync = os.fsync

    def spying_fsync(fd: int) -> None:
        # While the new bytes are flushed: the old file, whole, and a hidden temporary beside it.
        seen.append((path.read_bytes(), listing(tmp_path)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spying_fsync)
    written = write_atomically(path, NEW)
    assert seen[0][0] == OLD
    assert [name for name in seen[0][1] if not temporary_names(path).fullmatch(name)] == [
        "state.json"
    ]
    assert path.read_bytes() == NEW
    assert path.stat().st_ino == written.st_ino != old_inode  # renamed over, not rewritten
    assert (written.st_size, written.st_dev) == (len(NEW), path.stat().st_dev)
    assert listing(tmp_path) == ["state.json"]


def test_a_reader_racing_many_writes_reads_one_whole_version_each_time(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, OLD)
    versions = {OLD, NEW}
    torn: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            data = path.read_bytes()
            if data not in versions:
                torn.append(len(data))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            write_atomically(path, NEW if i % 2 == 0 else OLD)
    finally:
        done.set()
        reader.join()
    assert torn == []
    assert listing(tmp_path) == ["state.json"]


def test_a_failing_fsync_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, OLD)

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(path, NEW)
    assert path.read_bytes() == OLD
    assert listing(tmp_path) == ["state.json"]


def test_a_failing_rename_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, OLD)

    def failing_replace(src: object, dst: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="cross-device"):
        write_atomically(path, NEW)
    assert path.read_bytes() == OLD
    assert listing(tmp_path) == ["state.json"]


def test_a_staged_file_is_invisible_until_committed_and_gone_once_discarded(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    staged = stage(path, NEW)
    assert staged.parent == tmp_path
    assert temporary_names(path).fullmatch(staged.name)
    assert not path.exists()
    discard(staged)
    assert listing(tmp_path) == []
    staged = stage(path, NEW)
    commit(staged, path)
    assert listing(tmp_path) == ["state.json"]
    assert path.read_bytes() == NEW


def test_whatever_is_at_the_path_is_replaced_never_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(OLD)
    path = tmp_path / "state.json"
    path.symlink_to(elsewhere)
    write_atomically(path, NEW)
    assert elsewhere.read_bytes() == OLD
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert path.read_bytes() == NEW


# ----------------------------------------------------------------------------- mode, fsync


@pytest.mark.usefixtures("umask")
@pytest.mark.parametrize(("umask_bits", "mode"), [(0o077, 0o644), (0o000, 0o600), (0o022, 0o666)])
def test_the_mode_is_applied_whatever_the_umask(tmp_path: Path, umask_bits: int, mode: int) -> None:
    os.umask(umask_bits)
    path = tmp_path / "state.json"
    written = write_atomically(path, NEW, mode=mode)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert stat.S_IMODE(written.st_mode) == mode


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(
    tmp_path: Path, fsyncs: list[os.stat_result]
) -> None:
    path = tmp_path / "state.json"
    write_atomically(path, NEW)
    new = path.stat()
    directory = tmp_path.stat()
    synced = [(st.st_dev, st.st_ino) for st in fsyncs]
    assert synced == [(new.st_dev, new.st_ino), (directory.st_dev, directory.st_ino)]
    assert stat.S_ISREG(fsyncs[0].st_mode)
    assert fsyncs[0].st_size == len(NEW)  # flushed whole before it is synced
    assert stat.S_ISDIR(fsyncs[1].st_mode)


def test_fsync_directory_syncs_the_directory_itself(
    tmp_path: Path, fsyncs: list[os.stat_result]
) -> None:
    _files.fsync_directory(tmp_path)
    directory = tmp_path.stat()
    assert [(st.st_dev, st.st_ino) for st in fsyncs] == [(directory.st_dev, directory.st_ino)]


# ----------------------------------------------------------------------------- temporaries


_KILLED_WRITER = """
import resource, signal, sys
from pathlib import Path
from devplugin_sdk._files import write_atomically

# The kernel kills the process (SIGXFSZ, which Python ignores by default) inside write(2), 100
# bytes into the temporary file.
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
write_atomically(Path(sys.argv[1]), b"x" * 4096)
"""


def test_the_temporary_of_a_killed_writer_is_removed_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(OLD)
    env = {**os.environ, "PYTHONPATH": str(Path(_files.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], env=env, timeout=15, check=False
    )
    assert done.returncode == -signal.SIGXFSZ
    (left,) = [name for name in listing(tmp_path) if name != "state.json"]
    assert temporary_names(path).fullmatch(left)
    assert (tmp_path / left).stat().st_size == 100
    assert path.read_bytes() == OLD  # the old file, whole

    others = [
        ".other.json.0a1b2c3d.tmp",  # another file's temporary
        ".state.json.0a1b2c3.tmp",  # seven random characters
        ".state.json.0a1b2c3d9.tmp",
        ".state.json.0a1b.2c3d.tmp",
        ".state.json.0A1B2C3D.tmp",
        "state.json.0a1b2c3d.tmp",  # not hidden
        ".state.json.lock",
        ".state.0a1b2c3d.tmp",  # a former base, not asked for
    ]
    for name in others:
        (tmp_path / name).write_bytes(b"{")
    (tmp_path / ".state.json.deadbeef.tmp").mkdir()  # not a file
    (tmp_path / ".state.json.cafef00d.tmp").symlink_to(path)  # not a regular file
    assert remove_temporaries(path) == 1
    assert listing(tmp_path) == sorted(
        [*others, ".state.json.cafef00d.tmp", ".state.json.deadbeef.tmp", "state.json"]
    )
    assert path.read_bytes() == OLD


def test_temporaries_that_earlier_writers_named_after_a_former_base_are_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    ours = [
        ".state.json.0a1b2c3d.tmp",  # hex, as stage names them
        ".state.json.x_y0z9ab.tmp",  # tempfile.mkstemp's alphabet
        ".state.0a1b2c3d.tmp",  # an earlier writer named them after the stem
        ".metadata.k2_9abqz.tmp",  # another after a fixed prefix
    ]
    others = [".state.v2.0a1b2c3d.tmp", ".statex.0a1b2c3d.tmp", ".metadata.json.0a1b2c3d.tmp"]
    for name in [*ours, *others]:
        (tmp_path / name).write_bytes(b"{")
    names = temporary_names(path, former=("state", "metadata"))
    assert [name for name in ours if names.fullmatch(name)] == ours
    assert [name for name in others if names.fullmatch(name)] == []
    assert remove_temporaries(path, former=("state", "metadata")) == len(ours)
    assert listing(tmp_path) == sorted(others)


def test_removing_temporaries_of_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert remove_temporaries(tmp_path / "missing" / "state.json") == 0
