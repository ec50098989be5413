"""Evaluators Q(·) ∈ {0, 1}: one implementation per answer type, shared by all tasks."""
