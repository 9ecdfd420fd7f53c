"""OpenAI's Batch and Files APIs: routes, the batch jobs, the file store."""
