"""The gRPC front end (`steadyserve.v1.Inference`, health, reflection) on the shared engine.

This package's __init__ holds only the wire contract's names, so that the
client can import them without pulling in the server.
"""

SERVICE = "steadyserve.v1.Inference"

# Trailing-metadata keys (gRPC metadata keys are lower-case ASCII).
FINGERPRINT_KEY = "steadyserve-fingerprint"  # on every response, error or not
REQUEST_ID_KEY = "x-request-id"  # the request id, given or made up
RETRY_AFTER_KEY = "retry-after-ms"  # with RESOURCE_EXHAUSTED / UNAVAILABLE: when to retry
ERROR_FIELD_KEY = "steadyserve-error-field"  # with INVALID_ARGUMENT: the offending field
ERROR_CODE_KEY = "steadyserve-error-code"  # steadyserve's reason: overloaded, draining, deadline, ...
# gRPC's own retry machinery reads this one: a client with a retry policy waits this long.
PUSHBACK_KEY = "grpc-retry-pushback-ms"
