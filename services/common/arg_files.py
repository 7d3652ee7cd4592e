"""Flag values from files, for secrets: `--redis-url @/etc/pdserve/redis/url` reads the value
from the file (argparse's fromfile expansion: each line of the file becomes one word), so a
password reaches a service through a mounted Secret or a 0600 file, never its argv (visible in
/proc/PID/cmdline and `ps`) nor its environment. Every `pdserve` parser is made here, so the
CLI, the launcher's children and the container health check read argv alike.

A word that really starts with "@" must therefore be written as a file too.
"""

from __future__ import annotations

import argparse

PREFIX = "@"


def cli_parser(**kwargs) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="pdserve", fromfile_prefix_chars=PREFIX, **kwargs)
