"""What every API shares: transport (auth, errors, request ids, logs, OpenAPI, paging) and
translation (prompts, choices, streaming, tools, reasoning)."""
