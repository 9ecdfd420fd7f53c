"""Anthropic's Messages API and its Message Batches: routes, request mapping, event format."""
