"""The OpenAI-compatible HTTP server (Starlette on uvicorn)."""
