"""kernel_cache_service: a shared store of compiled programs keyed by (name, program fingerprint).

Files, one concept each:

- ``fingerprint.py`` — code + params fingerprints (``UNKNOWN`` when incomplete);
- ``keys.py`` — key validation (``[A-Za-z0-9._-]``, no ``..``, at most 200 characters);
- ``entry.py`` — :class:`EntryInfo` (the manifest) and :class:`PublishResult`;
- ``artifact.py`` — hashing, directory <-> tar blob, atomic install of a chunk stream;
- ``locks.py`` — flock-based entry locks, read leases, owned temp directories;
- ``store_api.py`` — :class:`KernelStoreAPI`, the Protocol both stores implement;
- ``store.py`` — :class:`KernelStore`, the on-disk store (embedded or behind the daemon), composing
  ``layout.py``, ``counters.py``, ``reads.py``, ``publish.py``, ``budget.py`` and ``leases.py``;
- ``s3_store.py`` — :class:`S3KernelStore`, the store in an S3 bucket behind a local disk tier
  (``cache serve --store s3://...``: hosts that share no disk share programs), with
  ``s3_entries.py`` and ``s3_read_through.py``;
- ``convert.py`` — :class:`EntryInfo` / :class:`PublishResult` <-> ``warmserve.v1`` messages;
- ``servicer.py`` — the ``warmserve.v1.KernelCache`` servicer and :func:`build_server`;
- ``daemon.py`` — ``warmserve cache serve``: the store behind the server bootstrap;
- ``client.py`` — :class:`KernelCacheClient` (daemon over gRPC, or an embedded store);
- ``cli.py`` — ``warmserve cache serve|put|get|ls|stat|evict``.
"""
