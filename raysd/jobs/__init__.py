"""Batch generation jobs: a prompt dataset in, one Parquet row per prompt out (`raysd generate`)."""

from raysd.jobs.config import DEFAULT_DRAFT, DEFAULT_TARGET, GenerateConfig, JobError
from raysd.jobs.runner import JobSummary, RunSummary, generate

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "GenerateConfig", "JobError", "JobSummary", "RunSummary", "generate"]
