"""The engine (private): what serves one plugin to the kubelet and keeps it served.

``served`` builds a plugin's state, streams and link and runs its registration strategy with
the plugin's ``handle`` (the one seam between them, with the ``Strategy`` type);
``supervisor`` restarts a failing plugin; ``servicer`` answers the five device-plugin RPCs,
with ``hooks`` (driving the plugin's coroutines), ``answers`` (pre-encoded replies), ``state``
(with ``conditions``, the health model, and ``listing``, what the kubelet is listed),
``streams``, ``feed`` (watch() to state), ``events`` and ``link``. The registration strategies
are ``kubelet_sock`` (register with kubelet.sock) and ``plugin_watcher`` (be found by the
kubelet's plugin watcher; its serve-until-lost loop serves the DRA driver's registrar too);
``kubelet_watch`` tells every plugin (and the DRA driver) when the kubelet's directories change.
Nothing here touches protobuf: that is ``devplugin_sdk._wire``.
"""
