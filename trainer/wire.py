"""The binary wire format of trainer messages: a small header, float64 scalars, payloads.

Each payload picks the cheapest index encoding for its own sparsity, so a sent element costs
at most 6 bytes (int32 index + fp16 value) and usually less:

| code | encoding | bytes for k of n elements (v = 1 for fp8, 2 for fp16, 4 for fp32) |
| ---- | -------- | ------------------------------------------------------- |
| 0 | dense    | n*v |
| 1 | int32    | k*(4+v) |
| 2 | bitmap   | ceil(n/8) + k*v |
| 3 | delta8   | (k+f8)*(1+v), f8 = filler entries for gaps over 255 |
| 4 | delta16  | (k+f16)*(2+v), f16 = filler entries for gaps over 65535 |
| 5 | seed     | 8 + k*v (random-k: indices regenerated from the seed) |

Values are fp32, fp16, bf16 or fp8, or raw bytes (uint8, dense: a checkpoint's optimizer state).

A delta filler is a zero value at an intermediate position, so decoding by summation is exact.
fp8 values (e4m3) carry their payload's scale as an fp32 right after the payload header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer.compression import FP8, Payload, random_indices

MAGIC = 0x4854
# Version 3 adds a UTF-8 text section (names of evaluation metrics, a model's layout, a reason
# to abort), empty and 4 bytes long on every per-step frame; version 4 raw-byte values (a
# STATE's optimizer state, which version 3 carried as base64 text: a third larger, and slow
# to pack and unpack, on the donor's step and the server's thread); version 5 bf16 values (the
# in-site exchange of sites as replicas); version 6 GRAD's seventh scalar, site_s.
VERSION = 6
_MSG = struct.Struct("<HBBqiHBI")
KIND_OFFSET = 3  # the kind byte, after the magic (2) and the version (1)
# numel and count as uint32: no single tensor reaches 2**32 elements, and on a small model the
# per-payload header is a visible share of a compressed frame (version 1 used int64 here).
_PAYLOAD = struct.Struct("<BBII")
_MAX_NUMEL = 2**32 - 1
_SEED = struct.Struct("<q")
_SCALE = struct.Struct("<f")

DENSE, INT32, BITMAP, DELTA8, DELTA16, SEED = range(6)
_VALUE_DTYPES = {0: torch.float32, 1: torch.float16, 2: FP8, 3: torch.uint8, 4: torch.bfloat16}
_VALUE_CODES = {v: k for k, v in _VALUE_DTYPES.items()}
# numpy has neither fp8 nor bf16: their bits travel as unsigned integers of their width and are
# viewed as the float again on arrival (both encode zero as all bits zero, as delta fillers need).
_NP = {torch.float32: np.float32, torch.float16: np.float16, FP8: np.uint8, torch.uint8: np.uint8,
       torch.bfloat16: np.int16}
_AS_BITS = {FP8: torch.uint8, torch.bfloat16: torch.int16}


def _scaled(dtype: torch.dtype) -> bool:
    """Whether values of `dtype` travel with a scale (fp8: `trainer.compression.FP8Values`)."""
    return dtype == FP8


@dataclass
class Message:
    """One encoded unit: kind, step, sender, scalars, text, payloads. Code reads and writes the
    typed frames of `trainer.frames`, which alone know what each scalar means."""

    kind: int
    step: int
    sender: int
    scalars: list[float] = field(default_factory=list)
    payloads: list[Payload] = field(default_factory=list)
    text: str = ""


def peek_kind(frame: torch.Tensor) -> int:
    """The kind of an encoded frame, without decoding it (a relay forwards updates unread)."""
    return int(frame[KIND_OFFSET])


def peek_head(frame: torch.Tensor) -> tuple[int, int, float]:
    """An encoded frame's kind, step and first scalar (NaN if none), without decoding the rest
    (a worker looks whether an update's last chunk has come, leaving it queued)."""
    buf = memoryview(frame.contiguous().numpy()).cast("B")
    _, _, kind, step, _, nscalars, _, _ = _MSG.unpack_from(buf, 0)
    first = struct.unpack_from("<d", buf, _MSG.size)[0] if nscalars else float("nan")
    return kind, step, first


def _fillers(gaps: torch.Tensor, max_gap: int) -> torch.Tensor:
    return torch.div(gaps - 1, max_gap, rounding_mode="floor")


def _gaps(indices: torch.Tensor) -> torch.Tensor:
    prev = torch.cat([indices.new_full((1,), -1), indices[:-1]])
    return indices - prev


def _filler_count(gaps: torch.Tensor, widest: int, max_gap: int) -> int:
    """How many filler entries a delta encoding of `gaps` needs (`widest`: their largest)."""
    if widest <= max_gap:
        # The usual case at the densities top-k sends: no gap needs a filler, and the scan for
        # them (an integer division over every gap, slow on a CPU) is skipped.
        return 0
    return int(_fillers(gaps[gaps > max_gap], max_gap).sum())


def _index_costs(p: Payload, vbytes: int) -> dict[int, int]:
    k = p.count
    if p.seed is not None:
        return {SEED: 8 + k * vbytes}
    gaps = _gaps(p.indices)
    widest = int(gaps.max()) if k else 0
    f8 = _filler_count(gaps, widest, 255)
    f16 = _filler_count(gaps, widest, 65535)
    return {
        INT32: k * (4 + vbytes),
        BITMAP: (p.numel + 7) // 8 + k * vbytes,
        DELTA8: (k + f8) * (1 + vbytes),
        DELTA16: (k + f16) * (2 + vbytes),
    }


def _encoding(p: Payload) -> tuple[int, int]:
    vbytes = p.values.element_size()
    if p.indices is None:
        return DENSE, p.numel * vbytes
    if p.seed is None and 8 * p.count >= p.numel:
        # From n/8 elements on, the bitmap's n/8 bytes are at most one byte per element: no
        # delta or int32 encoding can be smaller, so their index scans are skipped.
        return BITMAP, (p.numel + 7) // 8 + p.count * vbytes
    costs = _index_costs(p, vbytes)
    enc = min(costs, key=lambda c: (costs[c], c))
    return enc, costs[enc]


def payload_nbytes(p: Payload) -> int:
    """Exact encoded size of a payload, header (and an fp8 payload's scale) included."""
    return _PAYLOAD.size + (_SCALE.size if _scaled(p.values.dtype) else 0) + _encoding(p)[1]


def _delta(indices: torch.Tensor, values: torch.Tensor, max_gap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaps and values with a filler (gap `max_gap`, value 0) before each entry for every
    `max_gap` its gap is over the width. `values` are of a numpy dtype (fp8 as its bytes)."""
    gaps = _gaps(indices)
    if not gaps.numel() or int(gaps.max()) <= max_gap:
        return gaps, values  # no fillers
    # Only a few gaps are long (whole layers of small gradients): fillers are inserted before
    # those in one copy (3.2x a scatter of every entry into a new array, 165k entries).
    g = gaps.numpy()
    long = np.flatnonzero(g > max_gap)
    fill = (g[long] - 1) // max_gap
    rest = g.copy()
    rest[long] -= fill * max_gap
    before = np.repeat(long, fill)
    return (torch.from_numpy(np.insert(rest, before, max_gap)),
            torch.from_numpy(np.insert(values.numpy(), before, 0)))


def _encode_payload(p: Payload, out: list) -> None:
    if p.numel > _MAX_NUMEL:
        raise ValueError(f"a tensor of {p.numel} elements is over the wire format's 2**32 - 1")
    enc, _ = _encoding(p)
    values = p.values.detach().reshape(-1).cpu()
    if values.dtype not in _VALUE_CODES:
        values = values.float()
    vcode = _VALUE_CODES[values.dtype]
    scale = [_SCALE.pack(p.scale)] if _scaled(values.dtype) else []
    if values.dtype == torch.uint8 and enc != DENSE:
        raise ValueError("raw-byte values travel dense only")
    if values.dtype in _AS_BITS:
        values = values.view(_AS_BITS[values.dtype])
    count = values.numel()
    if enc in (DELTA8, DELTA16):
        gaps, values = _delta(p.indices.cpu(), values, 255 if enc == DELTA8 else 65535)
        count = values.numel()
        out.append(_PAYLOAD.pack(enc, vcode, p.numel, count))
        out.extend(scale)
        out.append(gaps.numpy().astype(np.uint8 if enc == DELTA8 else np.uint16).tobytes())
    else:
        out.append(_PAYLOAD.pack(enc, vcode, p.numel, count))
        out.extend(scale)
        if enc == INT32:
            out.append(p.indices.cpu().numpy().astype(np.int32).tobytes())
        elif enc == BITMAP:
            # numpy packs bits in one pass; the server's reply is often a bitmap of millions.
            bits = np.zeros(p.numel, dtype=bool)
            bits[p.indices.cpu().numpy()] = True
            out.append(np.packbits(bits, bitorder="little").tobytes())
        elif enc == SEED:
            out.append(_SEED.pack(p.seed))
    out.append(values.contiguous().numpy())


def _take(buf: memoryview, offset: int, dtype: np.dtype, count: int) -> tuple[np.ndarray, int]:
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).copy()
    return arr, offset + arr.nbytes


def _decode_payload(buf: memoryview, offset: int) -> tuple[Payload, int]:
    enc, vcode, numel, count = _PAYLOAD.unpack_from(buf, offset)
    offset += _PAYLOAD.size
    vdtype = _VALUE_DTYPES[vcode]
    indices: torch.Tensor | None = None
    seed = None
    scale = 1.0
    if _scaled(vdtype):
        (scale,) = _SCALE.unpack_from(buf, offset)
        offset += _SCALE.size
    if enc == INT32:
        arr, offset = _take(buf, offset, np.int32, count)
        indices = torch.from_numpy(arr).long()
    elif enc == BITMAP:
        arr, offset = _take(buf, offset, np.uint8, (numel + 7) // 8)
        # flatnonzero over bools is six times faster than over the bytes unpackbits returns.
        indices = torch.from_numpy(np.flatnonzero(np.unpackbits(arr, count=numel, bitorder="little").view(bool)))
    elif enc in (DELTA8, DELTA16):
        gap_arr, offset = _take(buf, offset, np.uint8 if enc == DELTA8 else np.uint16, count)
        gaps = torch.from_numpy(gap_arr.astype(np.int64))
        indices = gaps.cumsum(0) - 1
    elif enc == SEED:
        (seed,) = _SEED.unpack_from(buf, offset)
        offset += _SEED.size
        indices = random_indices(numel, count, seed)
    elif enc != DENSE:
        raise ValueError(f"unknown payload index encoding {enc}")
    arr, offset = _take(buf, offset, _NP[vdtype], count)
    values = torch.from_numpy(arr)
    if enc in (DELTA8, DELTA16):
        # Drop the fillers (zero values at a full-width gap); a real zero there adds nothing.
        full = 255 if enc == DELTA8 else 65535
        real = None if not count or int(gap_arr.max()) < full else (gaps != full) | (values != 0)
        if real is not None and not bool(real.all()):
            indices, values = indices[real], values[real]
            count = values.numel()
    if vdtype in _AS_BITS:
        values = values.view(vdtype)
    return Payload(numel=numel, values=values, indices=indices, seed=seed, scale=scale), offset


def encode(msg: Message) -> torch.Tensor:
    """The frame as a uint8 tensor, ready for a point-to-point send."""
    text = msg.text.encode()
    out: list = [_MSG.pack(MAGIC, VERSION, msg.kind, msg.step, msg.sender, len(msg.scalars), len(msg.payloads),
                           len(text))]
    out.append(np.asarray(msg.scalars, dtype=np.float64).tobytes())
    out.append(text)
    for p in msg.payloads:
        _encode_payload(p, out)
    # One copy: the pieces are numpy arrays where they can be, joined straight into the frame.
    return torch.frombuffer(bytearray().join(out), dtype=torch.uint8)


def decode(frame: torch.Tensor) -> Message:
    """Parse a frame produced by `encode`; raises ValueError on a foreign or truncated frame."""
    # A view, not a copy: every field is copied out of it below (`_take`).
    buf = memoryview(frame.contiguous().numpy()).cast("B")
    if len(buf) < _MSG.size:
        raise ValueError(f"frame of {len(buf)} bytes is shorter than the header")
    magic, version, kind, step, sender, nscalars, npayloads, ntext = _MSG.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a trainer frame (magic {magic:#x}, version {version})")
    scalars, offset = _take(buf, _MSG.size, np.float64, nscalars)
    text = bytes(buf[offset : offset + ntext]).decode()
    offset += ntext
    payloads = []
    for _ in range(npayloads):
        p, offset = _decode_payload(buf, offset)
        payloads.append(p)
    if offset != len(buf):
        raise ValueError(f"frame has {len(buf) - offset} trailing bytes")
    return Message(kind, step, sender, scalars.tolist(), payloads, text)
