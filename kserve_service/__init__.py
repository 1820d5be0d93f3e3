"""kserve_service: the KServe v2 / Triton door, ``inference.GRPCInferenceService`` on the
router's own port and in its process (no extra hop), over the router's core (:class:`router_service.router.Router`,
the interface the ``Generation`` servicer uses). See ``docs/architecture.md`` §10.

- ``model.py`` — the model as Triton's vLLM backend describes it: tensors, metadata, config;
- ``tensors.py`` — request tensors decoded and checked; Triton's BYTES serialization;
- ``convert.py`` — the ``Generate`` call of a request (sampling: :mod:`services.sampling_keys`)
  and ``ModelInferResponse`` messages;
- ``names.py`` — :class:`~kserve_service.names.ModelNames`, the model name and versions served;
- ``inference.py`` — one inference: a checked :class:`~kserve_service.inference.Plan`, its responses;
- ``stream.py`` — ``ModelStreamInfer``'s session (concurrent requests, in-stream errors);
- ``servicer.py`` — :class:`~kserve_service.servicer.KServeServicer`, every RPC;
- ``door.py`` — the door as a :data:`router_service.servicer.Door`, the router process's server;
- ``cli.py`` — puts the door into ``warmserve router serve``.
"""
