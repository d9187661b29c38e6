"""The fixtures these tests share with test_all.py: pytest finds a fixture by its name here."""

from test_all import setup, smollm2  # noqa: F401
