"""The claims side of the DRA driver: what the kubelet asks of it (NodePrepareResources,
NodeUnprepareResources) and the state that must survive it (prepared claims, their checkpoint,
CDI specs and metadata files), apart from the published pool, which it may look up but which
never sees it (upstream: the kubeletplugin helper and the driver's own state).
"""
