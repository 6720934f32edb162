"""This process's resident anonymous memory (Linux: RssAnon of /proc/self/status): the
heap and anonymous mappings, not the page cache of mapped files."""

from __future__ import annotations


def resident_anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")
