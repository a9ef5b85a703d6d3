"""The kubelet's side of ``bench_transport.py``: a blocking grpcio client in a process of its
own, calling Allocate on each ``LABEL=SOCKET`` in interleaved rounds; prints one JSON object,
label to samples in seconds.

    python _transport_client.py CALLS ROUNDS WARMUP LABEL=SOCKET...
"""

from __future__ import annotations

import json
import sys
import time

import grpc

from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc


def main() -> None:
    calls, rounds, warmup = (int(a) for a in sys.argv[1:4])
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["d0"])]
    )
    stubs = {}
    for spec in sys.argv[4:]:
        label, _, path = spec.partition("=")
        # A connection of its own per server, as the kubelet has per plugin.
        channel = grpc.insecure_channel(
            f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stubs[label] = pb_grpc.DevicePluginStub(channel)
    samples: dict[str, list[float]] = {label: [] for label in stubs}
    batch = max(calls // rounds, 1)
    clock = time.perf_counter
    for _ in range(rounds):
        for label, stub in stubs.items():
            for _ in range(warmup):
                stub.Allocate(request)
            got = samples[label]
            for _ in range(batch):
                started = clock()
                stub.Allocate(request)
                got.append(clock() - started)
    print(json.dumps(samples))


if __name__ == "__main__":
    main()
