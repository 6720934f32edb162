"""The one row schema of every A/B benchmark and its report table: ab_row, defined in
benchmarks/ab_driver.py."""

from benchmarks.ab_driver import ab_row as ab_row
