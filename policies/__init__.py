"""Adaptation policies; populated by a later issue."""
