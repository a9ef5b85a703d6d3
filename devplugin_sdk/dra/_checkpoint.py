"""The prepared claims of a DRA driver, kept in one file written atomically.

The kubelet may ask again for a claim it has already had prepared (after its own restart, or
ours) and asks to unprepare claims long after they were prepared, when the ResourceClaim may be
gone from the API. So what each prepared claim got (its devices, its CDI spec file) is written
down before NodePrepareResources answers, and read back when the plugin starts: a restart
neither loses a prepared claim nor prepares it twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice

__all__ = ["Checkpoint", "Entry"]

log = logging.getLogger("devplugin_sdk")

_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Entry:
    """One prepared claim: who it is, what the kubelet got for it, and its CDI spec file."""

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    spec_file: str | None = None


class Checkpoint:
    """The checkpoint file at ``path`` (blocking; call from a worker thread).

    Args:
        path: The file, e.g. ``/var/lib/kubelet/plugins/<driver>/checkpoint.json``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Entry]:
        """The prepared claims by UID; none when the file is missing.

        A file that cannot be read or parsed is logged and moved aside (``.corrupt``): the
        kubelet then prepares those claims again, and unpreparing a claim works without it.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            # Expected trouble on a node (permissions, I/O): the message, not a traceback.
            log.error("cannot read the DRA checkpoint %s: %s", self.path, exc)  # noqa: TRY400
            return {}
        try:
            return _parse(text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = self.path.with_name(self.path.name + ".corrupt")
            log.error(  # noqa: TRY400 - a damaged file is explained, not traced
                "the DRA checkpoint %s is not valid (%s); moved to %s, starting empty",
                self.path,
                exc,
                aside,
            )
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return {}

    def save(self, entries: Mapping[str, Entry]) -> None:
        """Replace the file with ``entries`` atomically (a reader sees the old or the new one).

        Raises:
            OSError: it could not be written; the previous file is unchanged.
        """
        data = {
            "format": _FORMAT,
            "claims": {uid: _raw(entry) for uid, entry in sorted(entries.items())},
        }
        payload = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)

    def remove_temporaries(self) -> int:
        """Remove temporary files a killed writer left; how many."""
        removed = 0
        prefix = f".{self.path.name}."
        with contextlib.suppress(OSError), os.scandir(self.path.parent) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                        removed += 1
        return removed


def _parse(text: str) -> dict[str, Entry]:
    data = json.loads(text)
    if data.get("format") != _FORMAT:
        raise ValueError(f"unknown format {data.get('format')!r}")
    return {uid: _entry(uid, raw) for uid, raw in data["claims"].items()}


def _raw(entry: Entry) -> dict[str, Any]:
    return {
        "namespace": entry.claim.namespace,
        "name": entry.claim.name,
        "specFile": entry.spec_file,
        "devices": [
            {
                "requests": list(d.request_names),
                "pool": d.pool,
                "device": d.device,
                "cdiDeviceIDs": list(d.cdi_ids),
            }
            for d in entry.devices
        ],
    }


def _entry(uid: str, raw: Mapping[str, Any]) -> Entry:
    devices = tuple(
        PreparedDevice(
            tuple(str(r) for r in d["requests"]),
            str(d["pool"]),
            str(d["device"]),
            tuple(str(c) for c in d["cdiDeviceIDs"]),
        )
        for d in raw["devices"]
    )
    spec = raw.get("specFile")
    return Entry(
        ClaimRef(str(raw["namespace"]), uid, str(raw["name"])),
        devices,
        str(spec) if spec else None,
    )
