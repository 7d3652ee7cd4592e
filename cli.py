"""The `pdserve` command line."""


def main(argv=None) -> int:
    raise SystemExit("pdserve: no commands yet")
