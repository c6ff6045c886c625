"""The OpenAI-compatible HTTP server over the engine: app, endpoints, schema, limits, metrics.

The server reaches the model only through `kiln.serve.engine` (no model or loading imports here).
"""
