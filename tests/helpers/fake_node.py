"""A stand-in for train.py in launcher tests: writes the metrics lines dpwa.cluster.monitor reads, without torch.

    python tests/helpers/fake_node.py RUN_DIR NAME MODE

MODE: "finish" writes start, two steps, an eval and an end line, saves an empty
model file and exits 0; "fail" prints an error and exits 3; "wait" writes
start and one step, then waits for SIGTERM and ends cleanly; "stubborn" does
the same but ignores SIGTERM. Waiting modes exit by themselves after 60 s, so
nothing outlives a broken test for long.
"""

import json
import signal
import sys
import threading
import time
from pathlib import Path

run_dir, name, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
stop = threading.Event()
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else (lambda *_: stop.set()))
metrics = open(run_dir / "metrics" / f"{name}.jsonl", "a")  # noqa: SIM115 - open for the process's life
peer = "w2" if name == "w1" else "w1"


def write(kind, **fields):
    metrics.write(json.dumps({"kind": kind, "t": time.time(), "node": name, **fields}) + "\n")
    metrics.flush()


if mode == "fail":
    print(f"{name}: something went wrong", flush=True)
    sys.exit(3)
write("start", epochs=1, steps_per_epoch=2)
write("step", epoch=1, step=1, loss=2.0, exchanges_per_s=4.0, averaged=1, failed=0, peers={peer: 1})
if mode == "finish":
    write("step", epoch=1, step=2, loss=1.0, exchanges_per_s=4.0, averaged=2, failed=1, peers={peer: 2})
    write("eval", epoch=1, step=2, test_acc=0.5 if name == "w1" else 0.75, test_loss=1.25)
    (run_dir / "models" / f"{name}.pt").write_bytes(b"")
    write("end", reason="done", step=2, averaged=2, failed=1, peers={peer: 2}, stats={"requests_served": 3})
    sys.exit(0)
print(f"{name}: waiting", flush=True)
stop.wait(60)
write("end", reason="stopped by SIGTERM", step=1, averaged=1, failed=0, peers={peer: 1}, stats={})
