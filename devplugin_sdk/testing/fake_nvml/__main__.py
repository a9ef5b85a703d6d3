"""``python -m devplugin_sdk.testing.fake_nvml``: see ``main``."""

from __future__ import annotations

import sys

from devplugin_sdk.testing.fake_nvml import main

sys.exit(main())
