"""Readers and fetchers of raw inputs, each checking its format strictly."""
