"""The wire (private): everything that touches protobuf messages and gRPC handler tables.

``server`` owns sockets (staged bind, publish, identity) and the ``unary`` handler helper;
``convert`` and ``dra_convert`` turn the SDK's types into messages and back; ``rpc`` holds the
device-plugin service's handler table; ``registration`` is the call to kubelet.sock,
``watcher_registration`` the plugin watcher's Registration service; ``client`` and
``dra_service``'s ``DraClient`` are the kubelet's side of the two APIs (used by the fakes, probe
and conformance); ``dra_model`` is the protocol-free shape of DRA claims.
"""
