"""acp-once: the Agent Client Protocol v2 where a prompt is inserted at most once."""
