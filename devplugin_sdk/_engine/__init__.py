"""The engine (private): what serves one plugin to the kubelet and keeps it served.

``served`` builds a plugin's state, streams and link and runs its registration strategy;
``supervisor`` restarts a failing plugin; ``servicer`` answers the five device-plugin RPCs,
with ``hooks`` (driving the plugin's coroutines), ``answers`` (pre-encoded replies), ``state``,
``streams``, ``feed`` (watch() to state), ``events`` and ``link``. The registration strategies
are ``kubelet_sock`` (register with kubelet.sock) and ``plugin_watcher`` (be found by the
kubelet's plugin watcher); ``kubelet_watch`` tells every plugin when the kubelet's directories
change. Nothing here touches protobuf: that is ``devplugin_sdk._wire``.
"""
