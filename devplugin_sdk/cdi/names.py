"""CDI names: the rules for a kind (``vendor.com/class``) and a device name, the fully
qualified name Allocate returns, and a spec's default file name (api/producer/identifiers.go,
api/producer/spec-names.go, specs-go/version.go of cncf-tags/container-device-interface).
"""

from __future__ import annotations

__all__ = ["cdi_name", "spec_file_name", "validate_device_name", "validate_kind"]


def _is_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _check_vendor_or_class(what: str, name: str, kind: str) -> None:
    # Vendor and class: start with a letter, end with a letter or digit, and in between
    # letters, digits, '_', '-' and '.' (api/producer/identifiers.go).
    if not name:
        raise ValueError(f"CDI kind {kind!r}: the {what} is empty")
    if not (name[0].isascii() and name[0].isalpha()):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must start with a letter")
    if not _is_alnum(name[-1]):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.")})
    if bad:
        raise ValueError(
            f"CDI kind {kind!r}: the {what} {name!r} may only contain letters, digits, "
            f"'_', '-' and '.', not {''.join(bad)!r}"
        )


def validate_kind(kind: str) -> tuple[str, str]:
    """Check a CDI kind (``vendor.com/class``) with the CDI rules.

    Returns:
        The vendor and the class.

    Raises:
        ValueError: naming the rule that is broken.
    """
    vendor, slash, klass = kind.partition("/")
    if not slash or not vendor or not klass:
        raise ValueError(f"CDI kind {kind!r} must look like 'vendor.com/class'")
    _check_vendor_or_class("vendor", vendor, kind)
    _check_vendor_or_class("class", klass, kind)
    return vendor, klass


def validate_device_name(name: str) -> None:
    """Check a CDI device name: letters, digits, ``_ - . :``, starting and ending alphanumeric.

    Raises:
        ValueError: naming the rule that is broken.
    """
    # Device names may start with a digit since CDI 0.5.0 (specs-go/version.go, requiresV050).
    if not name:
        raise ValueError("CDI device name must not be empty")
    if not (_is_alnum(name[0]) and _is_alnum(name[-1])):
        raise ValueError(f"CDI device name {name!r} must start and end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.:")})
    if bad:
        raise ValueError(
            f"CDI device name {name!r} may only contain letters, digits, '_', '-', '.' and ':', "
            f"not {''.join(bad)!r}"
        )


def cdi_name(kind: str, device: str) -> str:
    """The fully qualified CDI name ``vendor.com/class=device`` that Allocate returns.

    Raises:
        ValueError: if the kind or the device name breaks the CDI rules.
    """
    validate_kind(kind)
    validate_device_name(device)
    return f"{kind}={device}"


def spec_file_name(kind: str) -> str:
    """The default spec file name for ``kind``: ``<vendor>-<class>.json``, as the CDI producer
    names them (api/producer/spec-names.go).

    Raises:
        ValueError: if the kind breaks the CDI rules.
    """
    vendor, klass = validate_kind(kind)
    return f"{vendor}-{klass}.json"
