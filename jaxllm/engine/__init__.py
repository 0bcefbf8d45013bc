"""The engine: the core (scheduler + model runner, one step at a time) and the
frontends around it (offline LLMEngine, async client for the server)."""
