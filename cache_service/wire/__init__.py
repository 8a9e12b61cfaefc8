"""What crosses a process boundary: tensor and message codecs shared by the client and the
server, TLS credentials, the shared-memory regions, and the coordinator's end of the worker
channel. Imports the control plane's errors and `workers` (data-plane formats), never the
engine, the API or the client."""
