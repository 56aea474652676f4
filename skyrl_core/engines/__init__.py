"""What inference-engine plugins share, so that no engine plugin imports another (the sharing
policy is in docs/architecture.md).

- ``bootstrap``: the start inside the library's own processes (once per process, behind the
  marker the engine sets; ``skyrl_worker_init`` with the engine's name) and the allowlist check;
- ``lifecycle``: the engine's temporary work directory, environment variables set while the library
  starts its processes, the closed/asleep check before each call;
- ``model_dir``: a Hugging Face model directory for any ``ModelConfig`` (engines that load from
  disk), the checkpoint's tensor shapes and the checks on weights an update brings;
- ``requests``: the checks every engine makes on a ``GenerationRequest`` before sampling.

Nothing here imports an inference library.
"""
