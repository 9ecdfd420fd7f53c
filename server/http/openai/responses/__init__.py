"""OpenAI's Responses API and its Conversations: routes, request mapping, event format, stores,
background responses."""
