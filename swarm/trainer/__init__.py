"""The trainer role: reads data, drives microbatches through the stages, and its metrics; the
one-process reference it is measured against."""
