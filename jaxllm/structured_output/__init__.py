"""Structured outputs: a request's output constrained to a JSON schema, a regex, a
choice or a grammar (llguidance), as a token bitmask the jitted sampler applies.

`params` (the request's constraint, plain Python) is what the frontend and the
scheduler see; `manager` (compiling grammars off the engine loop, filling each step's
bitmask with numpy) belongs to the engine core."""
