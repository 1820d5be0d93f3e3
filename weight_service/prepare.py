"""``prepare()``: make sure a valid sidecar exists for (source, dtype) and say how warm it is.

``dtype`` is the sidecar's weights dtype (``f32``, ``bf16``, ``int8``, ``int4``) or ``auto``:
the checkpoint's own (:func:`weight_service.checkpoint.native_weights_dtype`: int4 for a
Q4_0/Q4_1 GGUF, bf16 for a bfloat16 safetensors checkpoint, f32 otherwise), or f32 when the
family does not pack that one. It is resolved before anything else, so the sidecar directory and
the handle always name the concrete dtype.

Under the sidecar's file lock (one pack per sidecar across processes; a second caller waits and
then finds the published result):

1. remove crash garbage (``.tmp-*``) in the sidecar directory;
2. unless ``force``, validate the existing sidecar against the checkpoint's current fingerprint
   (:func:`weight_service.sidecar.validate_sidecar`); valid ones are probed for page-cache
   residency: ``>= 0.95`` is HOT; otherwise the cold policy decides: ``accept`` (readahead advice,
   state COLD) or ``reject`` (repack);
3. with an object store (``remote``, ``weights serve --store s3://...``) and no ``force``: fetch
   the sidecar another host uploaded for the same checkpoint, dtype and code
   (:mod:`weight_service.s3_sidecars`: verified file by file, then validated like a local one);
   its state is then its residency's (HOT or COLD), never BUILT;
4. pack (:func:`weight_service.packer.pack_sidecar`): BUILT when no sidecar existed, REBUILT when
   one was stale, invalid, forced or rejected as cold; with an object store, upload it.

The object store is an optimisation, never a dependency: when it cannot be reached, a fetch
falls back to packing and a failed upload leaves the packed sidecar serving; both are logged
(warnings). A valid local sidecar the store lacks (packed before ``--store`` was given) is
uploaded on its next Prepare.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from model_families import family_for_architecture
from model_families.family import ModelFamily
from services.errors import InvalidArgument, Untrusted, WarmserveError
from services.paths import default_sidecar_root
from services.signing import SigningKey, TrustedKeys
from weight_service.checkpoint import native_weights_dtype, source_architecture
from weight_service.manifest import check_own_manifest, sign_sidecar, verify_sidecar
from weight_service.packer import pack_sidecar
from weight_service.progress import ProgressEvent
from weight_service.residency import HOT_THRESHOLD, advise_willneed, probe_residency
from weight_service.sidecar import (
    WEIGHTS_FILE,
    InvalidSidecar,
    SidecarInfo,
    check_dtype,
    remove_temp_files,
    sidecar_dir_name,
    validate_sidecar,
)
from weight_service.sources import ResolvedSource, resolve_source, source_fingerprint

if TYPE_CHECKING:
    from weight_service.s3_sidecars import RemoteSidecars

log = logging.getLogger(__name__)

COLD_POLICIES = ("accept", "reject")
LOCK_DIR = ".locks"


@dataclass(frozen=True)
class SidecarHandle:
    """A valid, published sidecar.

    ``path`` is the sidecar directory; ``size_bytes`` the size of ``model.safetensors`` in bytes;
    ``residency`` the resident fraction in ``[0, 1]`` or ``None`` when unknown; ``state`` one of
    ``"HOT"``, ``"COLD"``, ``"BUILT"``, ``"REBUILT"``; ``family`` the model family (``"llama"``);
    ``dtype`` the weights dtype (``"f32"``, ``"bf16"``, ``"int8"``, ``"int4"``; never ``auto``);
    ``source`` the checkpoint path; ``seconds`` the time the call took.
    """

    path: Path
    fingerprint: str
    size_bytes: int
    residency: float | None
    state: str
    family: str
    dtype: str
    source: str
    seconds: float

    @classmethod
    def from_info(cls, info: SidecarInfo, *, residency: float | None, state: str, seconds: float) -> SidecarHandle:
        """The handle of a validated sidecar."""
        return cls(path=info.path, fingerprint=info.fingerprint, size_bytes=info.size_bytes,
                   residency=residency, state=state, family=info.family, dtype=info.dtype,
                   source=info.source, seconds=seconds)


def residency_state(residency: float | None) -> str:
    """``"HOT"`` when ``residency >= 0.95``, else ``"COLD"`` (also when unknown)."""
    return "HOT" if residency is not None and residency >= HOT_THRESHOLD else "COLD"


def sidecar_lock(root: Path, name: str) -> FileLock:
    """The cross-process lock of sidecar ``name`` (``<root>/.locks/<name>.lock``)."""
    locks = Path(root) / LOCK_DIR
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{name}.lock"))


def resolve_weights_dtype(dtype: str, src: ResolvedSource, family: ModelFamily) -> str:
    """``dtype``, or for ``auto`` the checkpoint's own weights dtype (f32 when ``family`` does
    not pack it). Raises ``InvalidArgument`` for a dtype ``family`` does not pack."""
    check_dtype(dtype)
    if dtype == "auto":
        native = native_weights_dtype(src)
        return native if native in family.weights_dtypes else "f32"
    return family.check_weights_dtype(dtype)


def locate_sidecar(source: str, dtype: str, root: Path) -> tuple[ResolvedSource, ModelFamily, str, Path]:
    """Resolve ``source``, pick its model family and resolve ``dtype``
    (:func:`resolve_weights_dtype`); returns ``(source, family, weights dtype, sidecar
    directory)`` where the directory is ``root / "<slug>-<path hash>-<family>-<dtype>"`` (it may
    not exist). Raises ``InvalidArgument`` for a bad source or dtype or an unsupported
    architecture."""
    check_dtype(dtype)
    src = resolve_source(source)
    family = family_for_architecture(source_architecture(src))
    dtype = resolve_weights_dtype(dtype, src, family)
    return src, family, dtype, Path(root) / sidecar_dir_name(src.slug, src.path_hash, family.name, dtype)


def prepare(source: str, *, dtype: str = "f32", root: Path | None = None, force: bool = False,
            cold_policy: str = "accept", progress: Callable[[ProgressEvent], None] | None = None,
            remote: RemoteSidecars | None = None, signing_key: SigningKey | None = None) -> SidecarHandle:
    """Return a valid sidecar for ``source`` in the weights dtype ``dtype`` (or ``auto``, see
    the module docstring), packing it when needed.

    ``source``: safetensors directory, ``.gguf`` file or ``"smollm2-135m-instruct"``.
    ``root``: the sidecar root (default ``services.paths.default_sidecar_root()``).
    ``force``: repack even when valid. ``cold_policy``: ``"accept"`` or ``"reject"``.
    ``progress``: called with :class:`ProgressEvent` s (at least one "validate" event).
    ``remote``: an object store to fetch the sidecar from instead of packing it, and to upload
    what is packed to (see the module docstring).
    ``signing_key``: the sidecar returned carries a manifest signed by it: one packed here is
    signed (:func:`weight_service.manifest.sign_sidecar`); an existing one without a current
    manifest of this key is repacked, never signed as found (nor is a fetched one whose bytes
    do not match such a manifest).

    Raises ``InvalidArgument`` for a bad source, dtype or policy, or an unsupported checkpoint
    (or one the dtype's layout cannot hold, e.g. int4 of a matrix whose width is not a multiple
    of 32);
    ``FailedPrecondition`` when the checkpoint changed during packing (nothing published).
    """
    start = time.perf_counter()
    check_dtype(dtype)
    if cold_policy not in COLD_POLICIES:
        raise InvalidArgument(f"cold policy must be one of {', '.join(COLD_POLICIES)}, got {cold_policy!r}")
    emit = progress or (lambda _e: None)
    root = Path(root) if root is not None else default_sidecar_root()
    src, family, dtype, directory = locate_sidecar(source, dtype, root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission: the caller's input, said plainly
        raise InvalidArgument(f"cannot use {root} as the sidecar root: {e.strerror or e}") from e
    name = directory.name

    with sidecar_lock(root, name):
        garbage = remove_temp_files(directory)
        if garbage:
            log.info("removed temp files", extra={"sidecar": str(directory), "count": garbage})
        existed = (directory / WEIGHTS_FILE).exists()
        if existed and not force:
            emit(ProgressEvent("validate", message="checking the existing sidecar"))
            try:
                info = validate_sidecar(directory, source_fingerprint=source_fingerprint(src))
                if signing_key is not None:
                    check_own_manifest(info, signing_key)
            except InvalidSidecar as e:
                log.info("repacking", extra={"sidecar": str(directory), "reason": str(e)})
                emit(ProgressEvent("validate", message=f"repacking: {e}"))
            else:
                residency = probe_residency(directory / WEIGHTS_FILE)
                state = residency_state(residency)
                if state == "HOT" or cold_policy == "accept":
                    if state == "COLD":
                        advise_willneed(directory / WEIGHTS_FILE)
                    if remote is not None:
                        _share(remote, family, dtype, info, only_if_missing=True)
                    return SidecarHandle.from_info(info, residency=residency, state=state,
                                                   seconds=time.perf_counter() - start)
                emit(ProgressEvent("validate", message=f"repacking: cold (residency {residency})"))

        if remote is not None and not force:
            info = _fetch_remote(remote, family, dtype, directory, source_fingerprint(src), emit)
            if info is not None and signing_key is not None:
                info = _own_signed(info, signing_key)
            if info is not None:
                residency = probe_residency(directory / WEIGHTS_FILE)
                return SidecarHandle.from_info(info, residency=residency, state=residency_state(residency),
                                               seconds=time.perf_counter() - start)

        pack_sidecar(src, family, dtype, directory, emit)
        emit(ProgressEvent("validate", message="validating the new sidecar"))
        info = validate_sidecar(directory, source_fingerprint=source_fingerprint(src))
        log.info("packed sidecar", extra={"sidecar": str(directory), "dtype": dtype, "bytes": info.size_bytes})
        if signing_key is not None:
            sign_sidecar(info, signing_key)
        if remote is not None:
            _share(remote, family, dtype, info, only_if_missing=False)
        residency = probe_residency(directory / WEIGHTS_FILE)
        return SidecarHandle.from_info(info, residency=residency, state="REBUILT" if existed else "BUILT",
                                       seconds=time.perf_counter() - start)


def _own_signed(info: SidecarInfo, key: SigningKey) -> SidecarInfo | None:
    """``info`` (fetched from the object store) when its manifest is signed by ``key`` and every
    byte matches it; ``None`` otherwise (logged; the caller packs: a bucket writer's bytes are
    never signed here)."""
    try:
        verify_sidecar(info, TrustedKeys([key.public_key()]), remember=False)
    except Untrusted as e:
        log.warning("the sidecar in the object store is not signed by this service's key; packing it here",
                    extra={"sidecar": info.path.name, "error": str(e)})
        return None
    return info


def _fetch_remote(remote: RemoteSidecars, family: ModelFamily, dtype: str, directory: Path, source_fp: str,
                  emit: Callable[[ProgressEvent], None]) -> SidecarInfo | None:
    """The sidecar fetched from ``remote`` into ``directory`` (validated), or ``None`` when the
    store has none, it was corrupt or invalid, or the store cannot be reached (logged; the
    caller packs)."""
    key = remote.key(directory, family, dtype, source_fp)
    emit(ProgressEvent("fetch", message=f"looking for the sidecar in {remote.url}"))
    try:
        info = remote.fetch(key, directory, source_fingerprint=source_fp)
    except (WarmserveError, OSError) as e:
        log.warning("could not fetch the sidecar from the object store; packing it here",
                    extra={"sidecar": directory.name, "error": str(e)})
        return None
    if info is not None:
        emit(ProgressEvent("fetch", message=f"fetched from {remote.url}"))
    return info


def _share(remote: RemoteSidecars, family: ModelFamily, dtype: str, info: SidecarInfo, *,
           only_if_missing: bool) -> None:
    """Upload ``info`` to ``remote`` (``only_if_missing``: after a HEAD says the store lacks it).
    Best effort: a failure is logged and the local sidecar serves anyway."""
    key = remote.key(info.path, family, dtype, info.metadata["warmserve.source_fingerprint"])
    try:
        if only_if_missing and remote.has(key):
            return
        remote.upload(key, info)
    except (WarmserveError, OSError) as e:
        log.warning("could not upload the sidecar to the object store; it serves from this host only",
                    extra={"sidecar": info.path.name, "error": str(e)})
