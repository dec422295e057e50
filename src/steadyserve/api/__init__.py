"""Front ends: HTTP (OpenAI-compatible, SSE, WebSocket) and gRPC, on one engine."""
