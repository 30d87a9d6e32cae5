"""The wire: generated gRPC stubs (v1), the OpenAI schema, adapter chunks and status codes."""
