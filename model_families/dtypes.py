"""The dtype names of the command lines and the sidecars, torch-free so a CLI can import them.

:data:`WEIGHTS_DTYPES` are a sidecar's (what they hold: :mod:`model_families.family`);
:data:`COMPUTE_DTYPES` are the runner's compute and KV-cache dtypes
(:func:`runner_service.device.resolve_dtype`).
"""

#: Sidecar weights dtypes: float ones, then weight-only quantized ones.
WEIGHTS_DTYPES = ("f32", "bf16", "int8", "int4")
#: ``--weights-dtype`` choices of every command line (``auto``: the checkpoint's own, see
#: :mod:`weight_service.prepare`).
WEIGHTS_DTYPE_CHOICES = ("auto", *WEIGHTS_DTYPES)
#: Compute and KV-cache dtypes.
COMPUTE_DTYPES = ("f32", "bf16")
#: What a bf16 runner multiplies its quantized matrices by (``--quantized-activations``): ``int8``,
#: each row's activations quantized per group of 32 (llama.cpp's Q8 activations, AVX512-VNNI), or
#: the ``bf16`` activations as they are.
QUANTIZED_ACTIVATIONS = ("int8", "bf16")
