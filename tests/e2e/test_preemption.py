"""Ctrl-C and SIGTERM as train.py's ranks see them (``hdet_scale.lm.preemption.StopSignal``), in a child process
that signals itself: the first asks for a clean stop, the same Ctrl-C delivered twice at once is one request,
and a second press later aborts at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from hdet_scale.lm.preemption import StopSignal

    stop = StopSignal(group=None)
    os.kill(os.getpid(), signal.{first})
    os.kill(os.getpid(), signal.SIGINT)  # the terminal's and the launcher's copy of the same Ctrl-C
    time.sleep(0.2)
    print("asked to stop:", stop.received == signal.{first}, flush=True)
    if {press_again}:
        time.sleep(StopSignal.REPEAT_SECONDS + 0.5)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C pressed again
        time.sleep(5)
        print("still running", flush=True)
""")


def run_child(first: str, press_again: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD.format(first=first, press_again=press_again)],
                          capture_output=True, text=True, timeout=60)


def test_the_first_ctrl_c_asks_for_a_checkpoint_and_a_repeat_at_once_does_not_abort():
    result = run_child("SIGINT", press_again=False)
    assert result.returncode == 0, result.stderr
    assert "asked to stop: True" in result.stdout and "Traceback" not in result.stderr
    assert result.stderr.count("received SIGINT; stopping at the next safe point to checkpoint") == 1


def test_a_second_ctrl_c_later_stops_at_once_without_a_checkpoint():
    result = run_child("SIGINT", press_again=True)
    assert result.returncode == 130 and "still running" not in result.stdout
    assert "SIGINT again; stopping now, without a checkpoint" in result.stderr


def test_sigterm_is_a_clean_stop_too():
    result = run_child("SIGTERM", press_again=False)
    assert result.returncode == 0 and "asked to stop: True" in result.stdout


FINISHING = textwrap.dedent("""
    import os, signal, time
    from hdet_scale.lm.preemption import StopSignal

    stop = StopSignal(group=None)
    stop.stop_polling()  # train.py's last evaluation, checkpoint and model export follow
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    print("wrote the last checkpoint and model", flush=True)
    stop.close()
""")


def test_a_sigterm_while_the_run_finishes_waits_for_its_last_checkpoint():
    """The handlers were restored before the final evaluation, checkpoint and export, so a SIGTERM then (Slurm's
    time limit) killed the rank in the middle of writing them."""
    result = subprocess.run([sys.executable, "-c", FINISHING], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "wrote the last checkpoint and model" in result.stdout
    assert "received SIGTERM while the run finishes; it writes its last checkpoint and model first" in result.stderr


STOPPING = textwrap.dedent("""
    import os, signal, time
    from hdet_scale.lm.preemption import StopSignal

    stop = StopSignal(group=None)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the ranks agree on a stop, then write the checkpoint
    stop.stop_polling()
    time.sleep(StopSignal.REPEAT_SECONDS + 0.5)
    os.kill(os.getpid(), signal.SIGINT)  # pressed again while that checkpoint is written
    time.sleep(5)
    print("still running", flush=True)
""")


def test_a_second_ctrl_c_while_the_stop_checkpoints_stops_at_once():
    """Once the ranks agreed on the stop (its checkpoint can take minutes), a second Ctrl-C was only noted, and the
    run went on: the docs promise that it aborts at once."""
    result = subprocess.run([sys.executable, "-c", STOPPING], capture_output=True, text=True, timeout=60)
    assert result.returncode == 130 and "still running" not in result.stdout, result.stderr
    assert "SIGINT again; stopping now, without a checkpoint" in result.stderr
