"""The chaos soak: a seeded nemesis of faults through real mechanisms, a
workload of concurrent TrainingJobs run by a stand-in trainer, a history of
what the API server, S3 and the trainers showed, and independent checkers.
See docs/reliability.md."""
