"""k3launch's stand-in for ``vllm serve``: same argv and env, real rendezvous, OpenAI API, no GPUs.

Run as ``python -m k3launch.sim serve MODEL [flags]`` (or ``k3launch-sim serve ...``). It
accepts exactly the flags of the vendored vLLM schema, makes vLLM's startup checks, performs
the TP/PP master, DP coordinator and NIXL side-channel exchanges over real TCP (so a wrong
address, rank or port fails as on GPUs), then serves ``/health``, ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (plain and SSE), ``/metrics`` and ``/version``,
answering (``n`` choices, stream chunks, errors) as vLLM does; with ``--enable-fault-tolerance``
also vLLM 0.33.0's ``/fault_tolerance/apply`` and ``/fault_tolerance/status`` (:mod:`k3launch.sim.ft`). It depends on the standard library
and ``k3launch.planning.schema``/``k3launch.errors`` only, so it runs in a minimal container image.

Environment knobs (besides vLLM's own VLLM_HOST_IP, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT,
VLLM_ENGINE_READY_TIMEOUT_S, VLLM_MAX_N_SEQUENCES and k3launch's K3LAUNCH_PROCESS marker):

=====================================  =======================================================
K3LAUNCH_SIM_VLLM_VERSION              flag schema version (default: k3launch's default, 0.33.0)
K3LAUNCH_SIM_LOAD_S                    simulated weight-loading time before ready (default 2)
K3LAUNCH_SIM_TTFT_MS / _ITL_MS         time to first token / between tokens (default 20 / 2)
K3LAUNCH_SIM_BATCH_COST                a decode step's stretch per other request of its rank (default 0)
K3LAUNCH_SIM_GPUS                      GPUs per node (default 8)
K3LAUNCH_SIM_IDLE_W / _WATTS_PER_SEQ   a GPU's simulated draw: idle, and per request decoded (default 100 / 15)
K3LAUNCH_SIM_POWER_DIR                 where that draw is published (k3launch.sim.power; default /tmp/...)
K3LAUNCH_SIM_RENDEZVOUS_TIMEOUT_S      how long groups wait for members (default: the ready timeout)
K3LAUNCH_SIM_FAIL                      a fault to simulate (below)
K3LAUNCH_SIM_FAIL_AFTER_S              when the timed faults fire (default: half the load time)
K3LAUNCH_SIM_FAIL_PROCESS              apply the fault only where K3LAUNCH_PROCESS equals this
K3LAUNCH_SIM_FT_DETECT_S               fault tolerance: a lost peer or stalled collective to unhealthy (default 2)
K3LAUNCH_SIM_FT_RETRY_S                fault tolerance: a retry's duration once every DP rank joined (default 0.5)
=====================================  =======================================================

Faults (``K3LAUNCH_SIM_FAIL``):

* ``exit-during-load`` — exit 1 K3LAUNCH_SIM_FAIL_AFTER_S into loading, never ready;
* ``hang`` — load, then never become ready (no API server);
* ``crash-after-ready`` — serve, then exit 1 (EngineDeadError) K3LAUNCH_SIM_FAIL_AFTER_S later;
* ``zero-tokens`` — serve, but every completion is a 200 with no tokens (empty text,
  ``completion_tokens`` 0), so k3launch up's readiness probe already refuses it;
* ``empty-after-ready`` — the first completion request each API server admits (k3launch up's
  readiness probe) is answered normally; every later one is a 200 with no tokens, as with
  ``zero-tokens`` — an engine that passes readiness and then generates nothing. Counted per
  request, not timed, so a probe can never land on the wrong side of the switch;
* ``collective-timeout`` — serve, then K3LAUNCH_SIM_FAIL_AFTER_S later this rank's EP all-to-all
  stops completing with every process alive: with fault tolerance its DP group turns unhealthy
  until ``retry`` reaches every rank; without, exit 1 (EngineDeadError);
* ``corrupt-pd`` — serve; a decode whose request came over the P/D path (its KV cache pulled from
  a prefill) answers with wrong tokens after the first, 200 and /health 200 throughout; the same
  decode asked directly is right. Only the correctness canary catches it.
* ``other-weights`` — serve; every answer has wrong tokens after the first: another model served
  under the same name, which only the canary catches.
* ``latch`` — serve; after the first completion (up's probe) every admitted request holds its
  slot and never gets a token or an answer, /health 200 throughout: "up but not serving".
"""
