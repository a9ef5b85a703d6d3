"""The prepared claims of a DRA driver, kept in one file written atomically, and its formats.

The kubelet may ask again for a claim it has already had prepared (after its own restart, or
ours) and asks to unprepare claims long after they were prepared, when the ResourceClaim may be
gone from the API. So what each prepared claim got (its devices, its CDI spec file) is written
down before NodePrepareResources answers, and read back when the plugin starts: a restart
neither loses a prepared claim nor prepares it twice. The file is read like any file from
outside (regular files only, a size cap, never blocking), lives in a directory only we can
write, and a file that fails any check is set aside rather than trusted or deleted. The file
names its format: an older one is converted on reading (and written in the current one at the
next save); one newer than this version knows is set aside like a damaged file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplugin_sdk import _files
from devplugin_sdk._files import read_file
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
from devplugin_sdk.dra._claims.shares import Use
from devplugin_sdk.errors import ConfigError

__all__ = [
    "FORMAT",
    "MAX_CHECKPOINT_BYTES",
    "Checkpoint",
    "Content",
    "Entry",
    "Loaded",
    "Staged",
    "private_directory",
]

log = logging.getLogger("devplugin_sdk")

#: The format this version writes: 1 held the claims; 2 adds ``generation``, one more on every
#: save (another instance's writes show in it).
FORMAT = 2
#: The largest checkpoint read: a prepared claim takes 1 to 4 KiB with the content of its files
#: (its CDI spec and metadata, kept to write them again), and a node has a few hundred pods at
#: most (110 by default); a bigger file is not ours.
MAX_CHECKPOINT_BYTES = 4 << 20
# The end of every file this version writes (``_payload``): the generation is the last key.
_TAIL = re.compile(rb'"generation": (\d{1,19})\}\s*\Z')
# ``written_generation`` of a missing file.
_MISSING = -1


@dataclass(frozen=True, slots=True)
class Content:
    """What a prepare wrote for a claim, recorded with it so that its files are written again when
    they are gone: ``/var/run/cdi`` is a tmpfs that a reboot empties while the checkpoint
    survives, and the kubelet's repeated prepare must get CDI IDs that resolve. Recorded rather
    than made again with ``allocate()``: the same bytes the containers got, without the API, the
    plugin or the device's health at that moment, and no side effect run twice.

    Attributes:
        spec: The claim's CDI spec as runtimes read it (``CdiSpec.to_dict``); None: none.
        metadata: Each request's ``DeviceMetadata`` document, by request name.
    """

    spec: Mapping[str, Any] | None = None
    metadata: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Entry:
    """One prepared claim: who it is, what the kubelet got for it, and its CDI spec file.

    ``recovered`` entries were rebuilt from a CDI spec file when the checkpoint could not be
    read: the claim's UID and spec are known, and what its metadata files say (its namespace,
    name and devices, which other claims are then refused). The spec is kept until the kubelet
    unprepares the claim, or prepares it again (which records it in full).
    """

    claim: ClaimRef
    devices: tuple[PreparedDevice, ...]
    spec_file: str | None = None
    recovered: bool = False
    #: What its devices hold beyond themselves: shares taken, admin access (``_shares``).
    uses: tuple[Use, ...] = ()
    #: What its files hold, to write them again (None: recorded by an earlier version).
    content: Content | None = None


@dataclass(frozen=True, slots=True)
class Loaded:
    """What ``Checkpoint.load`` found: the entries and the file's generation, the older format
    it was converted from, and why the file was not used, if it was not (then it was moved to
    ``aside``)."""

    entries: dict[str, Entry] = field(default_factory=dict)
    problem: str | None = None
    aside: Path | None = None
    generation: int = 0
    converted_from: int | None = None


@dataclass(frozen=True, slots=True)
class Staged:
    """A checkpoint written to a temporary file (``Checkpoint.stage``), not yet in place."""

    path: Path
    generation: int


def private_directory(path: Path) -> None:
    """Make ``path`` (and its missing parents) a directory only its owner can write.

    New directories get 0700 whatever the umask (``mkdir``'s mode is filtered by it); an
    existing one loses group and other write permission, so no other user can rename a forged
    checkpoint over ours.
    """
    missing = []
    for parent in (path, *path.parents):
        if parent.exists():
            break
        missing.append(parent)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
            # The parents are the kubelet's (/var/lib/kubelet/plugins): readable, as it makes them.
            directory.chmod(0o700 if directory == path else 0o755)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o022:
        path.chmod(mode & ~0o022)
        log.warning(
            "the DRA plugin directory %s was writable by others (%s); now %s",
            path,
            oct(mode),
            oct(mode & ~0o022),
        )


class Checkpoint:
    """The checkpoint file at ``path`` (blocking; call from a worker thread).

    Args:
        path: The file, e.g. ``/var/lib/kubelet/plugins/<driver>/checkpoint.json``.

    Attributes:
        generation: The generation of the file last read or written (0 before either); each
            save writes the next one.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.generation = 0
        # The generation of the file as this object last left it (``_MISSING``: no file); None
        # before it looked.
        self._known: int | None = None
        # Each claim's line in the file, with the entry it encodes (``_payload``).
        self._lines: dict[str, tuple[Entry, str]] = {}

    def load(self) -> Loaded:
        """The prepared claims by UID; none when the file is missing.

        A file of an older format is converted (and written in the current one at the next
        save). A file that cannot be trusted (unreadable, not a regular file, larger than
        ``MAX_CHECKPOINT_BYTES``, not valid, of a format this version does not know, writable
        by others) is moved aside (``.corrupt``) and reported in ``Loaded.problem``; the caller
        decides what the CDI specs on disk still prove.
        """
        name = str(self.path)
        try:
            os.lstat(name)
        except FileNotFoundError:
            self._known = _MISSING
            return Loaded()
        except OSError as exc:
            return self._aside(f"cannot read it: {exc.strerror or exc}")
        try:
            data = read_file(name, MAX_CHECKPOINT_BYTES)
            owner = os.stat(name)
        except (ConfigError, OSError) as exc:
            reason = exc.reason if isinstance(exc, ConfigError) else exc.strerror or str(exc)
            return self._aside(reason)
        if owner.st_uid != os.geteuid() or owner.st_mode & 0o022:
            return self._aside(
                f"another user could have written it (owner {owner.st_uid}, "
                f"mode {oct(stat.S_IMODE(owner.st_mode))})"
            )
        try:
            loaded = _parse(data)
        except RecursionError:
            return self._aside("nested too deep")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return self._aside(str(exc))
        self.generation = loaded.generation
        self._known = loaded.generation if loaded.converted_from is None else None
        return loaded

    def _aside(self, problem: str) -> Loaded:
        # The next save must not repeat the generation another instance wrote here: it would
        # take our file for the one it knows.
        written = self.written_generation()
        if written is not None and written > self.generation:
            self.generation = written
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)  # an older quarantined file is replaced
        except OSError as exc:
            problem += f" (and it could not be moved aside: {exc.strerror or exc})"
            self._known = None
            return Loaded(problem=problem)
        self._known = _MISSING
        return Loaded(problem=problem, aside=aside)

    def changed(self) -> bool:
        """Whether the file is other than this object last read or wrote it: another process
        (a second instance of the driver) wrote it since.

        The generation written in the file tells, not its inode, size and modification time:
        a file replaced in place, or an inode reused, with the same size within one tick of
        the file system's clock, would look unchanged. A file whose generation cannot be read
        (an older format, a damaged one) counts as changed (``load`` then judges it).
        """
        return self._known is None or self.written_generation() != self._known

    def written_generation(self) -> int | None:
        """The generation at the end of the file (``_MISSING`` without one); None when it
        cannot be read from the last bytes (not a file this version wrote)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return _MISSING
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            tail = os.pread(fd, 64, max(0, st.st_size - 64))
        except OSError:
            return None
        finally:
            os.close(fd)
        match = _TAIL.search(tail)
        return int(match[1]) if match else None

    def save(self, entries: Mapping[str, Entry]) -> None:
        """Replace the file with ``entries`` atomically (a reader sees the old or the new one).

        Raises:
            OSError: it could not be written; the previous file is unchanged.
        """
        self.commit(self.stage(entries))

    def stage(self, entries: Mapping[str, Entry]) -> Staged:
        """Write ``entries`` (as the next generation) to a new temporary file beside the
        checkpoint, fsynced: ``commit`` makes it the checkpoint, ``discard`` removes it. A
        prepare stages the checkpoint while its CDI spec is written, and commits once the spec
        is durable.

        Raises:
            OSError: it could not be written; no temporary file is left.
        """
        generation = self.generation + 1
        payload = self._payload(entries, generation)
        if not self.path.parent.is_dir():
            private_directory(self.path.parent)
        return Staged(_files.stage(self.path, payload, mode=0o600), generation)

    def commit(self, staged: Staged) -> None:
        """Rename a ``stage``d file over the checkpoint and fsync the directory (the rename
        itself survives a crash): one fsync for the file, one for the directory.

        Raises:
            OSError: it could not be renamed (the staged file is removed; the previous
                checkpoint is unchanged) or the directory not fsynced.
        """
        _files.commit(staged.path, self.path)
        self.generation = self._known = staged.generation

    @staticmethod
    def discard(staged: Staged) -> None:
        """Remove a ``stage``d file that will not be committed."""
        _files.discard(staged.path)

    def _payload(self, entries: Mapping[str, Entry], generation: int) -> bytes:
        """The file's bytes: one line per claim, each encoded once and reused while its entry
        is the same object (a node with a hundred prepared claims would otherwise encode all of
        them on every prepare: about 0.9 ms of a worker thread holding the GIL)."""
        lines = []
        cache: dict[str, tuple[Entry, str]] = {}
        for uid, entry in sorted(entries.items()):
            cached = self._lines.get(uid)
            if cached is None or cached[0] is not entry:
                cached = (entry, f"{json.dumps(uid)}: {json.dumps(_raw(entry), sort_keys=True)}")
            cache[uid] = cached
            lines.append(cached[1])
        self._lines = cache
        claims = "\n " + ",\n ".join(lines) + "\n" if lines else ""
        return (
            f'{{"claims": {{{claims}}}, "format": {FORMAT}, "generation": {generation}}}\n'
        ).encode()

    def remove_temporaries(self) -> int:
        """Remove temporary files a killed writer left; how many."""
        return _files.remove_temporaries(self.path)


# ------------------------------------------------------------------ formats


def _from_format_1(data: dict[str, Any]) -> dict[str, Any]:
    """Format 1 is format 2 without a generation: such a file counts as generation 0."""
    return {**data, "format": 2, "generation": 0}


#: Each older format's conversion to the next one: a file is converted step by step to
#: ``FORMAT`` and read as that; a format without a conversion (a newer one) is not read.
_UPGRADES: dict[object, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _from_format_1}


def _parse(text: bytes) -> Loaded:
    data = json.loads(text)
    if not isinstance(data, dict):
        raise TypeError(f"a JSON object was expected, not {type(data).__name__}")
    was = data.get("format")
    while data.get("format") != FORMAT:
        convert = _UPGRADES.get(data.get("format"))
        if convert is None:
            raise ValueError(
                f"unknown format {data.get('format')!r} (this version reads formats up to {FORMAT})"
            )
        data = convert(data)
    generation = data["generation"]
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise TypeError("generation is not a count")
    claims = {uid: _entry(uid, raw) for uid, raw in data["claims"].items()}
    older = was if isinstance(was, int) and was != FORMAT else None
    return Loaded(claims, generation=generation, converted_from=older)


def _raw(entry: Entry) -> dict[str, Any]:
    return {
        "namespace": entry.claim.namespace,
        "name": entry.claim.name,
        "specFile": entry.spec_file,
        **({"recovered": True} if entry.recovered else {}),
        "devices": [
            {
                "requests": list(d.request_names),
                "pool": d.pool,
                "device": d.device,
                "cdiDeviceIDs": list(d.cdi_ids),
                **({"shareID": d.share_id} if d.share_id else {}),
            }
            for d in entry.devices
        ],
        **({"uses": [u.to_raw() for u in entry.uses]} if entry.uses else {}),
        **({"content": _content_raw(entry.content)} if entry.content is not None else {}),
    }


def _content_raw(content: Content) -> dict[str, Any]:
    return {
        **({"spec": content.spec} if content.spec is not None else {}),
        "metadata": content.metadata,
    }


def _content(raw: object) -> Content | None:
    # A field older versions ignore (the format stays 2: instances of both versions share the
    # file during a rolling upgrade); one that is not what this version writes is dropped.
    if not isinstance(raw, dict):
        return None
    spec, metadata = raw.get("spec"), raw.get("metadata", {})
    if not (spec is None or isinstance(spec, dict)) or not isinstance(metadata, dict):
        return None
    return Content(spec, {str(k): v for k, v in metadata.items() if isinstance(v, dict)})


def _entry(uid: str, raw: Mapping[str, Any]) -> Entry:
    devices = tuple(
        PreparedDevice(
            tuple(str(r) for r in d["requests"]),
            str(d["pool"]),
            str(d["device"]),
            tuple(str(c) for c in d["cdiDeviceIDs"]),
            str(d.get("shareID") or ""),
        )
        for d in raw["devices"]
    )
    spec = raw.get("specFile")
    return Entry(
        ClaimRef(str(raw["namespace"]), uid, str(raw["name"])),
        devices,
        str(spec) if spec else None,
        recovered=raw.get("recovered") is True,
        uses=tuple(Use.from_raw(u) for u in raw.get("uses", [])),
        content=_content(raw.get("content")),
    )
