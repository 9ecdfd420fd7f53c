"""Speculation: the drafters (prompt lookup, predictions), verification of their proposals, and how
many tokens each row drafts (the policy and its cost model)."""
