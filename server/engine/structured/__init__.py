"""Structured output: grammars for JSON schemas and tool calls (llguidance), lazy tool-call
grammars, reasoning budgets."""
