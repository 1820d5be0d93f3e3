"""Compiled programs: the decode and prefill steps built once, kept in the kernel cache, loaded warm
(``docs/architecture.md`` §9). ``spec``: what a runner compiles; ``key``: its kernel-cache key;
``export_specs``: example inputs and dynamic dims; ``aoti`` / ``inductor``: the two modes; ``cache``:
fetch, publish and single flight; ``load``: the entry point, :func:`~runner_service.programs.load.load_programs`.
"""
