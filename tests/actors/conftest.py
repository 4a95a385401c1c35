"""Fixtures for the actor tests: `local_ray` is the session's shared Ray (tests/conftest.py)."""
