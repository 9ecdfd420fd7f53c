"""OpenAI's API: chat and text completions, embeddings, tokenize; the Responses API (responses/)
and the Batch and Files APIs (batches/)."""
