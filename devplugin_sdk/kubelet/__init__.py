"""The kubelet's side, for tests and for checking a plugin: no part of it runs in a plugin.

- ``fake``: ``FakeKubelet``, the kubelet's device manager as the protocol reference describes it
  (``devplugin fake-kubelet`` runs it);
- ``fake_dra``: its DRA side (``FakeDraKubelet``), and ``memory_api``: ``MemoryApi``, an API
  server's ResourceSlices in memory;
- ``probe``: call a running plugin as the kubelet would (``devplugin probe``);
- ``conformance``: the kubelet's expectations as checks (``devplugin conformance``).

``devplugin_sdk.testing`` re-exports the fakes for tests. These modules use the wire
(``devplugin_sdk._wire``) and never the engine: what they check is the plugin's behaviour on the
socket, not the SDK's insides.
"""

from __future__ import annotations

import importlib

__all__ = ["FakeKubelet", "MemoryApi"]

# Loaded on first use: ``devplugin probe`` starts without the fakes.
_MODULE_OF = {"FakeKubelet": "fake", "MemoryApi": "memory_api"}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'devplugin_sdk.kubelet' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"devplugin_sdk.kubelet.{module}"), name)
    globals()[name] = value
    return value
