"""Pydantic models of the OpenAI wire format plus our extensions. No MLX imports here."""
