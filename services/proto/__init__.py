"""Generated gRPC stubs (``make proto``). Import e.g. ``from services.proto import generation_pb2``."""

from services.proto.warmserve.v1 import (  # noqa: F401
    generation_pb2,
    generation_pb2_grpc,
    kernel_cache_pb2,
    kernel_cache_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    weights_pb2,
    weights_pb2_grpc,
)
