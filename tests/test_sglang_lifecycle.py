"""Lifecycle of the in-process SGLang engine (the real SGLang 0.5.2 on CPU, its real processes): shutdown, a second
engine, two side by side, exit without shutdown, the spawn guard, and a scheduler that dies at start or while
serving."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch

from sglang_helpers import configs, dataproto, pythonpath, use_sglang_cpu

PROMPTS = [[1, 504, 3456, 28], [1, 17, 99]]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fake():
    use_sglang_cpu()


def gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def greedy(rollout, model_cfg):
    return rollout.generate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False})).batch["responses"]


def test_two_engines_stop_independently_and_release_everything():
    """Two engines side by side; the first shut down (SGLang's own Engine.shutdown would kill the second's scheduler
    too); the second keeps serving until its scheduler is killed; with the last engine the process group goes."""
    import torch.distributed as dist
    from final.errors import EngineError
    from final.rollout.sglang.rollout_052 import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    with SGLangRollout(sg_cfg, model_cfg) as first, SGLangRollout(sg_cfg, model_cfg) as second:
        engines = (first.sglang_engine, second.sglang_engine)
        assert len({e.server_args.port for e in engines} | {e.port_args.nccl_port for e in engines}) == 4
        expected = greedy(first, model_cfg)
        pids = [p.pid for p in first.sglang_engine.processes]
        ipc = first.sglang_engine.port_args.scheduler_input_ipc_name[len("ipc://"):]
        assert pids and os.path.exists(ipc)
        first.shutdown()
        first.shutdown()  # idempotent
        assert gone(pids) and not os.path.exists(ipc) and dist.is_initialized()  # the second still needs it
        with pytest.raises(EngineError, match="shut down"):
            greedy(first, model_cfg)
        assert torch.equal(greedy(second, model_cfg), expected)
        pid = second.sglang_engine.processes[0].pid

        async def killed_while_awaiting():
            os.kill(pid, signal.SIGKILL)  # the request goes to a dead scheduler: without the watch, a hang
            return await second.agenerate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))

        with pytest.raises(EngineError, match=f"process {pid} exited while serving.*create a new engine"):
            asyncio.run(killed_while_awaiting())
        with pytest.raises(EngineError, match="exited while serving"):  # refused up front from now on
            greedy(second, model_cfg)
        pids = [p.pid for p in second.sglang_engine.processes]
    assert gone(pids) and not dist.is_initialized()


def test_a_fresh_engine_after_the_last_one_then_a_scheduler_killed_during_a_cartridge_rpc():
    from final.errors import EngineError
    from final.rollout.sglang.rollout_052 import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    kv = [torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)]
    with SGLangRollout(sg_cfg, model_cfg) as rollout:  # same process, fresh group, ports and scheduler
        assert greedy(rollout, model_cfg).shape == (2, 12)
        assert rollout.load_cartridge("a", kv, kv) == 4
        proc = rollout.sglang_engine.processes[0]
        proc.kill()
        proc.wait()  # reaped: no zombie left for the watch to see; the RPC's own check notices
        with pytest.raises(EngineError, match="scheduler|exited while serving"):
            rollout.load_cartridge("b", kv, kv)


def test_a_scheduler_that_dies_unseen_during_start_still_ends_the_start():
    """SGLang's `_launch_subprocesses` starts the scheduler, then the detokenizer (whose start reaps children that
    have already exited), then reads the scheduler's "ready" from a pipe whose write end it holds itself. A
    scheduler that died at once was never seen among this process's children, and that read waited forever. The
    watch now reads the launched processes from that frame; on the death, release_start ends the read."""
    import multiprocessing as mp
    import threading

    from final.rollout.sglang.procs import ProcessWatch, release_start

    ended, deaths = [], []

    def _launch_subprocesses():  # the name the watch looks for, and SGLang's locals
        reader, writer = mp.Pipe(duplex=False)
        scheduler_procs = [mp.get_context("fork").Process(target=os._exit, args=(3,))]
        scheduler_procs[0].start()
        scheduler_procs[0].join()
        mp.active_children()  # what the next Process.start() does: the dead scheduler is reaped
        try:
            reader.recv()
        except EOFError:
            ended.append(scheduler_procs[0].pid)

    starter = threading.Thread(target=_launch_subprocesses, daemon=True)
    starter.start()
    watch = ProcessWatch(lambda pid: (deaths.append(pid), release_start(starter.ident)), 0.05, starter.ident)
    starter.join(timeout=60)
    watch.stop()
    assert not starter.is_alive() and ended and deaths == ended


def test_a_scheduler_failing_at_start_becomes_an_engine_error_not_a_dead_process():
    from final.errors import EngineError
    from final.rollout.sglang.rollout_052 import SGLangRollout
    from final.rollout.sglang.procs import new_children

    sg_cfg, _, model_cfg = configs(sglang_args={"max_total_tokens": -2})  # the scheduler cannot build its pool
    children = {p.pid for p in psutil.Process().children()}
    with pytest.raises(EngineError, match="exited while starting"):
        SGLangRollout(sg_cfg, model_cfg)  # the dying scheduler SIGQUITs this process, which must survive it
    assert signal.getsignal(signal.SIGQUIT) not in (signal.SIG_DFL, None)
    assert gone([p.pid for p in new_children(children)])


SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from sglang_helpers import configs, dataproto

def main():
    from final.rollout.sglang.rollout_052 import SGLangRollout
    sg_cfg, _, model_cfg = configs()
    rollout = SGLangRollout(sg_cfg, model_cfg)
    out = rollout.generate_sequences(dataproto(model_cfg, [[1, 17, 99]], {{"do_sample": False}}))
    print("scheduler", rollout.sglang_engine.processes[0].pid, tuple(out.batch["responses"].shape), flush=True)
    # no shutdown: atexit must end the scheduler and the interpreter must not hang

{call}
"""


def run_script(tmp_path: Path, call: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(repo=str(REPO / "tests"), call=call)))
    env = {**os.environ, "PYTHONPATH": pythonpath(str(REPO))}  # the kernel stubs, for the script and its children
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)


def test_a_script_that_exits_without_shutdown_leaves_nothing_behind(tmp_path):
    done = run_script(tmp_path, 'if __name__ == "__main__":\n    main()')
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("scheduler"))
    assert line.endswith("(1, 12)")
    assert gone([int(line.split()[1])])


def test_an_unguarded_script_is_told_to_use_a_main_guard(tmp_path):
    done = run_script(tmp_path, "main()")
    assert done.returncode != 0
    assert 'if __name__ == "__main__":' in done.stderr and "re-imports your main script" in done.stderr
