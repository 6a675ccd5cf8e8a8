"""Preference pairs: from agent run logs (from_logs: the retraining rules and garblers), pairs a model makes for itself (self_pairs) and the model's own scored attempts as run logs (attempts)."""
