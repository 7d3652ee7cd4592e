"""`python -m pdserve.services.exec_tied PROGRAM [ARGS...]`: run a child of the launcher (our
services, taskset, redis-server) so that it gets SIGTERM when the launcher dies.

Why a trampoline instead of a `preexec_fn`: a `preexec_fn` makes subprocess use fork() rather
than vfork(), and fork() runs every pthread_atfork handler in the parent. In a process with
gRPC, OpenMP and oneDNN threads those handlers can deadlock (seen: the test process hung inside
fork) or leave the child broken before exec (seen: a child that died at start with only gRPC's
"epoll_wait error" in its log). Here the parent-death signal is set by a fresh process that has
no threads yet, and survives the exec into PROGRAM.
"""

from __future__ import annotations

import os
import sys

from pdserve.services.launcher import die_with_parent


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m pdserve.services.exec_tied PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    die_with_parent()
    os.execvp(argv[0], argv)  # does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
