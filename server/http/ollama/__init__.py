"""Ollama's API (/api/*): routes, request mapping, answer format."""
