"""rollout.name: sglang — an in-process SGLang engine, one file per concern; each lane's SGLang is one rollout file.

config.py        both lanes: requirements (GPU unless SGLang's CPU device, the package), RolloutConfig -> ServerArgs
                 and its checks (attention backend, ports, one GPU, memory saver), SamplingParams' keys
procs.py         both lanes: the engine's own processes (watch, kill), SIGQUIT survival, the event-loop policy
scheduler.py     code run inside SGLang's scheduler child (cartridge injection into the radix cache; 0.5.2's
                 stop strings without a tokenizer)
cartridges.py    the parent's side of cartridges: reserved token ids, RPCs to the scheduler
rollout_052.py   verl06 lane: veRL 0.6.0's SGLangRollout on SGLang 0.5.2 (owner thread, lifecycle); engine_052.py:
                 veRL's classes subclassed (ServerArgs, processes, cartridge prefixes, scoring arguments)
rollout_0512.py  verl09 lane: SGLang 0.5.12's Engine under final's EngineRollout (veRL 0.9.1 has no in-process
                 SGLangRollout)

final.compat.SGLANG_ROLLOUT names the lane's class. Nothing here imports sglang at module level except
engine_052.py, so importing this package costs nothing where SGLang is absent.
"""
