"""Scoring answers by running them: the checker (the planted host, outcomes, the pass rule), graders (OpenAI's grader types) and GRPO's rewards."""
