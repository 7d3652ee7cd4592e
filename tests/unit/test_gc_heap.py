"""freeze_startup_heap: start-up's garbage collected, everything alive frozen. Run in a child
interpreter: the freeze is process-wide and would keep this test process's garbage for good."""

import subprocess
import sys
import textwrap


def test_freeze_collects_garbage_then_freezes_the_living():
    code = textwrap.dedent("""
        import gc, weakref
        from pdserve.services.common.gc_heap import freeze_startup_heap

        class Node:
            pass

        gc.disable()  # no pass runs on its own before the call: the call must do the collecting
        dead = Node(); dead.me = dead  # a cycle no one references any more
        gone = weakref.ref(dead)
        del dead
        alive = Node(); alive.me = alive
        assert gc.get_freeze_count() == 0
        n = freeze_startup_heap()
        assert gone() is None, "start-up garbage was frozen instead of collected"
        assert n == gc.get_freeze_count() and n > 1000, n
        assert alive.me is alive
        later = Node(); later.me = later  # objects made after the freeze are still collected
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None and gc.get_freeze_count() == n
        print("ok", n)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
