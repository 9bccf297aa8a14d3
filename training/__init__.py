"""Horovod data-parallel training on processed datasets."""
