"""Lifecycle of the in-process SGLang engine (fake SGLang 0.5.2, real processes): shutdown, a second engine, two
side by side, exit without shutdown, the spawn guard, and a scheduler that dies at start or while serving."""

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

from sglang_helpers import FAKE, configs, dataproto, use_fake_sglang

PROMPTS = [[1, 504, 3456, 28], [1, 17, 99]]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fake():
    use_fake_sglang()


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


def test_shutdown_releases_everything_and_a_second_engine_starts():
    import torch.distributed as dist
    from final.errors import EngineError
    from final.rollout.sglang import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    first = SGLangRollout(sg_cfg, model_cfg)
    expected = greedy(first, model_cfg)
    pids = [p.pid for p in first.sglang_engine.processes]
    ipc = [first.sglang_engine.port_args.scheduler_input_ipc_name[len("ipc://"):]]
    assert pids and os.path.exists(ipc[0])
    first.shutdown()
    first.shutdown()  # idempotent
    assert gone(pids) and not os.path.exists(ipc[0]) and not dist.is_initialized()
    with pytest.raises(EngineError, match="shut down"):
        greedy(first, model_cfg)
    with SGLangRollout(sg_cfg, model_cfg) as second:  # same process, fresh group, ports and scheduler
        assert torch.equal(greedy(second, model_cfg), expected)
        pids = [p.pid for p in second.sglang_engine.processes]
    assert gone(pids)


def test_two_engines_side_by_side_stop_independently():
    from final.rollout.sglang import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    with SGLangRollout(sg_cfg, model_cfg) as a, SGLangRollout(sg_cfg, model_cfg) as b:
        ports = {e.server_args.port for e in (a.sglang_engine, b.sglang_engine)} | \
            {e.port_args.nccl_port for e in (a.sglang_engine, b.sglang_engine)}
        assert len(ports) == 4
        expected = greedy(a, model_cfg)
        a.shutdown()  # SGLang's own Engine.shutdown would kill b's scheduler too
        assert torch.equal(greedy(b, model_cfg), expected)


def test_a_scheduler_killed_while_serving_becomes_an_engine_error():
    from final.errors import EngineError
    from final.rollout.sglang import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    with SGLangRollout(sg_cfg, model_cfg) as rollout:
        greedy(rollout, model_cfg)
        pid = rollout.sglang_engine.processes[0].pid

        async def killed_while_awaiting():
            os.kill(pid, signal.SIGKILL)  # the request goes to a dead scheduler: without the watch, a hang
            return await rollout.agenerate_sequences(dataproto(model_cfg, PROMPTS, {"do_sample": False}))

        with pytest.raises(EngineError, match=f"process {pid} exited while serving"):
            asyncio.run(killed_while_awaiting())
        with pytest.raises(EngineError, match="exited while serving"):  # refused up front from now on
            greedy(rollout, model_cfg)


def test_a_scheduler_killed_during_a_cartridge_rpc_becomes_an_engine_error():
    from final.errors import EngineError
    from final.rollout.sglang import SGLangRollout

    sg_cfg, _, model_cfg = configs()
    kv = [torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16)]
    with SGLangRollout(sg_cfg, model_cfg) as rollout:
        assert rollout.load_cartridge("a", kv, kv) == 4
        proc = rollout.sglang_engine.processes[0]
        proc.kill()
        proc.wait()  # reaped: no zombie left for the watch to see; the RPC's own check notices
        with pytest.raises(EngineError, match="scheduler|exited while serving"):
            rollout.load_cartridge("b", kv, kv)


def test_a_scheduler_failing_at_start_becomes_an_engine_error_not_a_dead_process():
    from final.errors import EngineError
    from final.rollout.sglang import SGLangRollout
    from final.rollout.sglang_procs import new_children

    sg_cfg, _, model_cfg = configs(sglang_args={"max_total_tokens": -2})  # the scheduler cannot build its pool
    children = {p.pid for p in psutil.Process().children()}
    with pytest.raises(EngineError, match="exited while starting"):
        SGLangRollout(sg_cfg, model_cfg)  # the dying scheduler SIGQUITs this process, which must survive it
    assert signal.getsignal(signal.SIGQUIT) not in (signal.SIG_DFL, None)
    assert gone([p.pid for p in new_children(children)])


SCRIPT = """
import sys
sys.path.insert(0, {fake!r})
sys.path.insert(0, {repo!r})
from sglang_helpers import configs, dataproto

def main():
    from final.rollout.sglang import SGLangRollout
    sg_cfg, _, model_cfg = configs()
    rollout = SGLangRollout(sg_cfg, model_cfg)
    out = rollout.generate_sequences(dataproto(model_cfg, [[1, 17, 99]], {{"do_sample": False}}))
    print("scheduler", rollout.sglang_engine.processes[0].pid, tuple(out.batch["responses"].shape), flush=True)
    # no shutdown: atexit must end the scheduler and the interpreter must not hang

{call}
"""


def run_script(tmp_path: Path, call: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(fake=FAKE, repo=str(REPO / "tests"), call=call)))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
