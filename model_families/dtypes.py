"""The dtype names of the command lines and the sidecars, torch-free so a CLI can import them.

:data:`WEIGHTS_DTYPES` are a sidecar's (what they hold: :mod:`model_families.family`);
:data:`COMPUTE_DTYPES` are the runner's compute and KV-cache dtypes
(:func:`runner_service.device.resolve_dtype`).
"""

#: Sidecar weights dtypes: float ones, then weight-only quantized ones.
WEIGHTS_DTYPES = ("f32", "bf16", "int8", "int4")
#: Compute and KV-cache dtypes.
COMPUTE_DTYPES = ("f32", "bf16")
