"""Generated gRPC stubs of proto/kvcache/v1 (scripts/gen-proto.sh); do not edit."""
