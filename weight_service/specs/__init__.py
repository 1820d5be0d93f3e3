"""Per-family pack specs (see :mod:`weight_service.pack_spec`)."""
