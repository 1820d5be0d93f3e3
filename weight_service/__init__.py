"""Prepacked, runner-ready weight sidecars (the sidecar format: ``docs/architecture.md``).

Where things are: ``sources`` (what a SOURCE names), ``safetensors_reader``/``gguf_reader`` +
``tokenizer_export`` (checkpoints under HF names; the family layouts are in
:mod:`model_families`),
``sidecar`` (format, fingerprints, validation, atomic publish), ``packer`` (streaming pack),
``residency`` (mincore probe), ``prepare`` (the lifecycle), ``s3_sidecars`` (sharing sidecars
through an S3 bucket: upload packs, fetch instead of packing), ``loader`` (zero-copy mapping),
``catalog``, ``convert`` (handles <-> messages), ``servicer``/``daemon``/``client`` (the ``Weights``
gRPC service), ``cli``.
"""
