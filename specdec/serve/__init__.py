"""specdec serve: an OpenAI-compatible HTTP server over an async engine (docs/api.md, "Server")."""
