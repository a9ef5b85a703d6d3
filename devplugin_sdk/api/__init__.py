"""The wire contract: the kubelet's .proto files, their committed generated code, and constants.

Only ``devplugin_sdk._wire.convert``, the gRPC plumbing and ``devplugin_sdk.testing`` import the
generated modules; plugin authors never need them.
"""
