"""The service's front: the gRPC servicer and its process setup, request decoding and reply
encoding, error -> status mapping, authentication, in-flight limits, and local sessions (the
same calls over a Unix socket)."""
