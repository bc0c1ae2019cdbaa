"""The HTTP server: OpenAI-compatible and native routes over the engine."""
