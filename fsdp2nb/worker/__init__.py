"""Runs on the ranks' host: the agent that forks ranks, and each rank's shell, capture and sampler."""
