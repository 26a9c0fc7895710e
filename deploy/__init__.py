"""Deployment tools: compose and Procfile generators, supervisor, health checks, bucket, model."""
