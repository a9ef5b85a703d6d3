"""The published side of the DRA driver: each served plugin's devices, the pool they make, its
ResourceSlices on the API server and the kubelet's health stream (upstream: the resourceslice
controller). It never imports the claims side.
"""
