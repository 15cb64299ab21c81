"""The request core every protocol front shares: one error vocabulary (errors), which copy of a
model takes a request (models), waiting on queued work (waiting), and the OIP inference core
(tensors) that HTTP and gRPC both call."""
