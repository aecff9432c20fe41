"""Stand-ins for a server's process group, for the tests of `LaunchedServer.stop`."""

# The leader, with multiprocessing's resource tracker beside it (as SGLang's has), and a child
# in its group that, on SIGTERM, finishes its work (1 s) and writes a marker; the leader itself
# ignores SIGTERM (SGLang's sets a flag), waits for the child, then "sleeps for diagnostics" (its
# third argument, s; by default far longer than any test would wait) and exits 3.
LEADER = r"""
import os, signal, subprocess, sys, time
from multiprocessing import resource_tracker
signal.signal(signal.SIGTERM, lambda *a: None)
resource_tracker.ensure_running()    # as SGLang's main process has: it ignores SIGTERM
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while not os.path.exists(sys.argv[2] + ".ready"):    # its SIGTERM handler is in place
    time.sleep(0.02)
print("up", flush=True)
child.wait()
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 120)
sys.exit(3)
"""
CHILD = r"""
import signal, sys, time
from pathlib import Path
def done(*a):
    time.sleep(1.0)
    Path(sys.argv[1]).write_text("flushed")
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
Path(sys.argv[1] + ".ready").touch()
while True:
    time.sleep(0.1)
"""
