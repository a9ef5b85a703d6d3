"""The one sysfs reader of the backends is bounded (issue 25, row 12): regular files of at most a
page, never blocking; the process-level test is in tests/reliability/test_bounds_faults.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devplugin_sdk.backends import _sysfs


def test_an_attribute_is_read_whole_up_to_a_page_through_links(tmp_path: Path) -> None:
    (tmp_path / "serial").write_text("x" * (_sysfs.MAX_ATTR_BYTES - 1) + "\n")
    (tmp_path / "link").symlink_to("serial")
    assert _sysfs.read_attr(tmp_path / "link") == "x" * (_sysfs.MAX_ATTR_BYTES - 1)


@pytest.mark.timeout(5)  # a FIFO opened for reading waits for a writer: for good, here
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "serial")
    assert _sysfs.read_attr(tmp_path / "serial") is None


def test_a_device_or_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "zero").symlink_to("/dev/zero")
    assert _sysfs.read_attr(tmp_path / "zero") is None
    assert _sysfs.read_attr(tmp_path) is None
    assert _sysfs.read_int(tmp_path / "missing") is None


def test_a_file_over_the_limit_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "serial"
    with big.open("wb") as attribute:
        attribute.truncate(400 * 1000 * 1000)  # sparse
    assert _sysfs.read_attr(big) is None
    small = tmp_path / "mig-minors"
    small.write_text("config 1\n" * 1000)
    assert _sysfs.read_attr(small) is None
    assert _sysfs.read_attr(small, limit=1 << 20) == ("config 1\n" * 1000).strip()
