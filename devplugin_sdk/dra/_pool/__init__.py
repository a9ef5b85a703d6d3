"""The published side of the DRA driver (upstream: the resourceslice controller): each served
plugin's strategy (``plugins``), what the pool publishes (``pool``, ``shares``), its split into
ResourceSlices (``slices``), the watch-fed view of what the server holds (``view``), the sync
loop (``publisher``) and its policy for fields a server drops (``dropped``), and the kubelet's
health stream (``health``). It never imports the claims side.
"""
