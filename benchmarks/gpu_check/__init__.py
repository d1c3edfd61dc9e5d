"""The GPU check: one command (`scripts/gpu_check`) that says, in one report, where the stack
stands on a machine with an accelerator: the environment, correctness on the device, decode and
prefill speed against the memory roofline, and the two services under load.

Data flow: `__main__` (no JAX) reads a profile from `plan` (gpu, rehearsal, cpu, smoke), then
runs each phase as a child process with a time limit, so that a phase that fails, hangs or
runs out of device memory costs only its own row and frees the device for the next:
  env, golden, real-model, speed-<shape>, weights,
  stack-model                                          -> `phases` (python -m benchmarks.gpu_check.phases)
  stack                                                -> benchmarks/transport.py --real-model DIR --json
  pytest                                               -> python -m pytest <the device tests> --junitxml
Each child writes one JSON file; `report` joins them, checks the targets and writes
gpu-check.json and gpu-check.md. Random weights of model shapes are built on the device by
`random_model` (no checkpoint is read); the stack's served model is written to disk once, since
`tokenwire decode-server` loads a directory.
"""
