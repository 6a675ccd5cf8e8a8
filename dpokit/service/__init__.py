"""The fine-tuning service: the SQLite store and scheduler (jobs), SLURM's scheduler (slurm), the app (service, serve) and its routers (api_*: OpenAI's API, nip's, chat, graders, exports)."""
