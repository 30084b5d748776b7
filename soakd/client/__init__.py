"""OpenAI-compatible streaming client: one request in, one RequestRecord out, never raises."""
