"""KV caches: the batch's caches (ragged rows, split attention) and the prefix cache in memory and
on disk."""
