"""Bucketed averaging over cross-replica groups on 4 real gloo ranks (2 replicas x 2 positions).

This file holds the tests that start a launcher or script as a subprocess; the tests that start no process are in
tests/unit/test_comm.py and the tests on gloo ranks are in tests/distributed/test_comm_distributed.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

EXIT_SCRIPT = """
import atexit, os, sys, threading, time
import torch.distributed as dist
from hdet_scale.comm import shut_down_and_exit

out = sys.argv[1]
dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
kept = dist.new_group([0])  # a group alive into exit, as torch keeps some


class Finalized:  # writes to an open descriptor with os.write bound now: works however far finalization went
    def __init__(self):
        self.fd = os.open(os.path.join(out, "finalized"), os.O_WRONLY | os.O_CREAT)

    def __del__(self, write=os.write):
        write(self.fd, b"finalized")


marker = Finalized()
atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
threading.Thread(target=lambda: (time.sleep(0.5), open(os.path.join(out, "thread"), "w").close())).start()
print("buffered, not flushed", end="")
shut_down_and_exit(3)
"""


def test_shut_down_and_exit_ends_like_a_normal_exit_up_to_finalization_and_skips_it(tmp_path):
    """Non-daemon threads finish, atexit handlers run, stdout is flushed and the code comes back; the interpreter
    never finalizes (a module object's ``__del__`` does not run), so no gloo thread can meet a finalizing one."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            env=environment, timeout=120)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, not flushed"
    assert (tmp_path / "thread").exists() and (tmp_path / "atexit").exists()
    assert (tmp_path / "finalized").read_bytes() == b""
