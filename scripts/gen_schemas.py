"""Write the JSON Schemas of ``devplugin run`` files to schemas/ (devplugin_sdk/cli/schemas.py).

Usage: python scripts/gen_schemas.py [--check]

--check writes nothing and exits 1 naming every file that differs from what would be written;
tests/config/test_schemas.py does the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from devplugin_sdk.cli.schemas import schemas

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "schemas"


def rendered() -> dict[Path, str]:
    """Each schema file's path and text."""
    return {
        OUT / f"{name}.json": json.dumps(schema, indent=2, sort_keys=False) + "\n"
        for name, schema in schemas().items()
    }


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: python scripts/gen_schemas.py [--check]", file=sys.stderr)
        return 2
    files = rendered()
    stale = sorted(str(p.relative_to(ROOT)) for p, text in files.items() if _read(p) != text)
    extra = sorted(str(p.relative_to(ROOT)) for p in OUT.glob("*.json") if p not in files)
    if check:
        for name in [*stale, *extra]:
            print(f"{name}: out of date; run python scripts/gen_schemas.py", file=sys.stderr)
        return 1 if stale or extra else 0
    OUT.mkdir(exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
    for name in extra:
        (ROOT / name).unlink()
    return 0


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
