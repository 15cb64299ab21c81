"""The descriptor pool of the generated modules: a private one, not protobuf's default.

tritonclient.grpc (and any other Triton client) registers the same `inference.*` names in the
default pool from its own, larger .proto files; two definitions of one name in one pool fail at
import. A private pool lets the server's stubs and a client's live in one process (in-process
tests, tools); the wire format does not depend on the pool. tools/grpc_stubs.py points the
generated modules here.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
