"""The weights digest: one exact definition shared by the engine and the publisher.

Called by ``rolloutfleet_worker.loader`` (hashing while tensors stream into the model on a GPU worker)
and by the operator's ``rolloutfleet digest`` / ``publish`` commands (hashing the files on any machine).
Its own distribution (``digest/pyproject.toml``) so that both images ship it and neither ships the other's
package.
It owns the safetensors header parsing, the per-tensor hash, the combination rule and the digest string
format. Pure Python plus the ``blake3`` package: no torch, no vLLM, no kopf, and deliberately not the
``safetensors`` package either (the operator may not import it, and raw byte ranges are all we need).

Definition (docs/digest.md is the long form)::

    h_t    = blake3(raw bytes of tensor t exactly as stored in the file)
    digest = blake3(b"rolloutfleet-digest-v1\\n"
                    + for t in tensors sorted by UTF-8 name:
                        name + b"\\0" + dtype + b"\\0" + ",".join(shape) + b"\\0" + h_t)
    string = "blake3:" + 64 lowercase hex chars
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypedDict

import blake3

DIGEST_PATTERN: Final = r"^blake3:[0-9a-f]{64}$"
DIGEST_RE: Final = re.compile(DIGEST_PATTERN)
DOMAIN: Final = b"rolloutfleet-digest-v1\n"
PREFIX: Final = "blake3:"

# The safetensors reference implementation refuses headers above 100 MB; so do we, so that a corrupt
# length field fails fast instead of allocating gigabytes.
MAX_HEADER_BYTES: Final = 100_000_000

# Bytes per element for the dtypes whose size we can check. Unknown dtypes (new packed formats) are
# still hashed byte-exactly; only the shape-vs-bytes check is skipped for them.
DTYPE_SIZES: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

Progress = Callable[[int, int], None]
"""``progress(bytes_done, bytes_total)``, called from the hashing thread after each tensor."""


class CheckpointError(Exception):
    """A checkpoint directory or file that cannot be digested; the message names the path."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's place in a file: enough to read, hash and describe it without loading it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in ``file``
    nbytes: int


class DigestReport(TypedDict):
    """What ``rolloutfleet digest --json`` prints and ``digest_report`` returns."""

    path: str
    digest: str
    tensors: int
    bytes: int
    files: int
    seconds: float


def is_digest(value: object) -> bool:
    """True when ``value`` is a well-formed digest string (the API models reuse DIGEST_PATTERN)."""
    return isinstance(value, str) and DIGEST_RE.match(value) is not None


def read_header(file: Path) -> list[TensorInfo]:
    """Parse one safetensors file's header and check every tensor lies inside the file.

    Raises CheckpointError naming ``file`` for a truncated or corrupt file.
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(file, f"truncated: {size} bytes, no safetensors header")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(file, f"corrupt or truncated header (length {hlen}, file {size} bytes)")
            raw = f.read(hlen)
    except OSError as exc:
        raise CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(file, f"corrupt header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(file, "corrupt header: not a JSON object")
    base = 8 + hlen
    data_len = size - base
    out: list[TensorInfo] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out.append(_tensor_info(file, name, entry, base, data_len))
    out.sort(key=lambda t: t.offset)
    return out


def _tensor_info(file: Path, name: str, entry: object, base: int, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(file, f"corrupt header entry for {name!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    ok = (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    )
    if not ok:
        raise CheckpointError(file, f"corrupt header entry for {name!r}: {entry!r}")
    assert isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list)
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(file, f"corrupt offsets for {name!r}: {offsets}")
    if end > data_len:
        raise CheckpointError(file, f"truncated: tensor {name!r} ends at {end}, data has {data_len} bytes")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is not None and numel * itemsize != end - begin:
        raise CheckpointError(file, f"corrupt: tensor {name!r} {dtype}{shape} has {end - begin} bytes")
    return TensorInfo(name, dtype, tuple(shape), file, base + begin, end - begin)


def scan_directory(path: Path | str) -> list[TensorInfo]:
    """All tensors of the ``*.safetensors`` files directly in ``path``, in file then offset order.

    Non-recursive on purpose: a checkpoint is one directory, and subfolders (optimizer state, older
    shards) must not leak into the digest. Raises CheckpointError for a missing directory, no files,
    a bad file, or a tensor name present in two files.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(root, "not a directory")
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors") and p.is_file())
    if not files:
        raise CheckpointError(root, "no *.safetensors files in directory")
    seen: dict[str, Path] = {}
    out: list[TensorInfo] = []
    for f in files:
        for t in read_header(f):
            if t.name in seen:
                raise CheckpointError(f, f"tensor {t.name!r} also present in {seen[t.name].name}")
            seen[t.name] = f
            out.append(t)
    return out


def record(name: str, dtype: str, shape: Iterable[int], tensor_hash: bytes) -> bytes:
    """The bytes one tensor contributes to the final hash (see the module docstring)."""
    if len(tensor_hash) != 32:
        raise ValueError("tensor hash must be 32 raw bytes")
    dims = ",".join(str(int(d)) for d in shape)
    return b"".join((name.encode("utf-8"), b"\0", dtype.encode("ascii"), b"\0", dims.encode(), b"\0", tensor_hash))


def _threads(threads: int | None) -> int:
    return blake3.blake3.AUTO if threads is None else max(1, threads)


class TensorHasher:
    """Incremental per-tensor hash: feed the stored bytes in any chunking, then ``finish()``."""

    __slots__ = ("_h", "info")

    def __init__(self, info: TensorInfo, *, threads: int | None = None) -> None:
        self.info = info
        # blake3's Rust core releases the GIL and splits large updates over threads.
        self._h = blake3.blake3(max_threads=_threads(threads))

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._h.update(chunk)

    def finish(self) -> bytes:
        digest: bytes = self._h.digest()
        return digest


class DigestBuilder:
    """Collects per-tensor hashes in any order and combines them in sorted name order.

    The streaming loader adds tensors as they are read; ``digest_directory`` adds them from mmaps.
    """

    def __init__(self) -> None:
        self._records: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
        self.bytes = 0

    def add(self, info: TensorInfo, tensor_hash: bytes) -> None:
        if info.name in self._records:
            raise CheckpointError(info.file, f"tensor {info.name!r} hashed twice")
        self._records[info.name] = (info.dtype, info.shape, tensor_hash)
        self.bytes += info.nbytes

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def hexdigest(self) -> str:
        h = blake3.blake3(DOMAIN)
        for name in sorted(self._records, key=lambda n: n.encode("utf-8")):
            dtype, shape, th = self._records[name]
            h.update(record(name, dtype, shape, th))
        return PREFIX + h.hexdigest()


def hash_tensor(view: bytes | bytearray | memoryview, info: TensorInfo, *, threads: int | None = None) -> bytes:
    """``h_t`` of one tensor's complete stored bytes."""
    hasher = TensorHasher(info, threads=threads)
    hasher.update(view)
    return hasher.finish()


def digest_report(path: Path | str, *, threads: int | None = None, progress: Progress | None = None) -> DigestReport:
    """Digest a checkpoint directory from its files, zero-copy (mmap slices fed to blake3)."""
    start = time.monotonic()
    infos = scan_directory(path)
    total = sum(t.nbytes for t in infos)
    builder = DigestBuilder()
    by_file: dict[Path, list[TensorInfo]] = {}
    for t in infos:
        by_file.setdefault(t.file, []).append(t)
    for file, tensors in by_file.items():
        _hash_file(file, tensors, builder, threads, progress, total)
    return DigestReport(
        path=str(path),
        digest=builder.hexdigest(),
        tensors=len(builder),
        bytes=builder.bytes,
        files=len(by_file),
        seconds=round(time.monotonic() - start, 6),
    )


def _hash_file(
    file: Path,
    tensors: list[TensorInfo],
    builder: DigestBuilder,
    threads: int | None,
    progress: Progress | None,
    total: int,
) -> None:
    try:
        # The mmap gives blake3 the page cache directly: no copy into Python memory. (read_header has
        # already refused empty files, the one size mmap cannot map.)
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm.size() < max((t.offset + t.nbytes for t in tensors), default=0):
                raise CheckpointError(file, "truncated while reading")
            view = memoryview(mm)
            try:
                for t in tensors:
                    # Release each slice at once: mmap.close() refuses while views are exported.
                    with view[t.offset : t.offset + t.nbytes] as part:
                        builder.add(t, hash_tensor(part, t, threads=threads))
                    if progress is not None:
                        progress(builder.bytes, total)
            finally:
                view.release()
    except OSError as exc:
        raise CheckpointError(file, f"unreadable: {exc.strerror or exc}") from exc


def digest_directory(path: Path | str, *, threads: int | None = None, progress: Progress | None = None) -> str:
    """The digest string of the checkpoint directory ``path`` (``"blake3:" + 64 hex``)."""
    return digest_report(path, threads=threads, progress=progress)["digest"]
