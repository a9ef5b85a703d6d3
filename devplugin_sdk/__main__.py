"""``python -m devplugin_sdk`` is the ``devplugin`` command."""

from devplugin_sdk.cli import main

raise SystemExit(main())
