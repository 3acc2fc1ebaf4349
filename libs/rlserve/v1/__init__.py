"""Generated gRPC/protobuf stubs of protos/rlserve/v1 (make protos)."""
