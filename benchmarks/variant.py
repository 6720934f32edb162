"""Variant: one configuration of an A/B benchmark, defined in benchmarks/ab_driver.py."""

from benchmarks.ab_driver import Variant as Variant
