"""The wire protocol: a fixed-size control exchange opens every phase of a call.

Shapes legend: W EP world size, X words of one control row (HEADER_WORDS + MESSAGE_WORDS + slots).

Every phase of a Dispatcher call (forward, its end, backward, its end; dispatch, combine and their
backwards) starts, or ends, with one ``all_to_all_single`` of a [W, X] int64 tensor whose size depends
only on what was agreed when the Dispatcher was built (W, max chunks, local experts). Row w goes to rank
w: the header below, an error message, then the slots (the per-chunk row counts for rank w when the
phase carries them). So the sizes of every variable-size exchange that follows are agreed, and a
mismatch of any kind - another call, another phase, another C or E, a failed check, a rank that raised
mid-call - is read from the header on every rank and raised there, never read as data.

    >>> hdr = header(Phase.FORWARD, dispatcher=0, call=3, chunks=2, experts=8, world=2)
    >>> hdr[Word.CALL], hdr[Word.MAGIC] == MAGIC
    (3, True)
"""
from __future__ import annotations

import enum
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["Word", "Phase", "Failure", "MAGIC", "HEADER_WORDS", "MESSAGE_WORDS", "header", "encode_message",
           "decode_message", "dtype_code", "dtype_name", "ProtocolError", "set_step", "current_step", "step_text"]

MAGIC = 0x6D6F455F636F6D6D  # "moE_comm": a row without it is not a moe_comm header (stale or mis-paired bytes)
HEADER_WORDS = 17
MESSAGE_WORDS = 32  # 256 bytes of UTF-8: the failing rank's error, read by its peers


class Word(enum.IntEnum):
    """Position of each header word in a control row."""

    MAGIC = 0
    DISPATCHER = 1  # the Dispatcher's index on its group (construction order, agreed when built)
    CALL = 2        # call number of that Dispatcher (the same on every rank)
    PHASE = 3       # Phase
    CHUNKS = 4      # C of this call (x its pieces: dispatch.send_rows.pieces)
    EXPERTS = 5     # E (global, physical)
    WORLD = 6       # W
    ROW_BYTES = 7   # H x element size (-1: unknown on a rank whose input was rejected)
    DTYPE = 8       # dtype_code of the rows (-1: unknown)
    CONFIG = 9      # hash of the settings every rank must share (strict, direct_min_bytes, ...)
    FAILED = 10     # Failure
    BAD_IDS = 11    # expert ids outside [-1, E)
    NONFINITE = 12  # rows holding NaN/Inf (strict mode)
    ROWS = 13       # N: rows this rank sends in this call
    CHUNK = 14      # chunk where a failure happened (-1: before the first exchange)
    TOP_K = 15      # K of the call's routing (sync-free mode sizes its fixed exchanges by it; -1: not sent)
    STEP = 16       # the training step the caller set (``set_step``; -1: none set), the same on every rank


assert list(Word) == list(range(HEADER_WORDS)), "header() lists the words in Word order"


class Phase(enum.IntEnum):
    FORWARD = 1        # pipelined call: counts exchange
    FORWARD_END = 2    # pipelined call: every rank completed its forward (or says why not)
    BACKWARD = 3
    BACKWARD_END = 4
    DISPATCH = 5       # dispatch(): counts exchange
    COMBINE = 6        # combine(): its inputs checked on every rank before rows move
    DISPATCH_BWD = 7
    COMBINE_BWD = 8


PHASE_TEXT = {Phase.FORWARD: "forward", Phase.FORWARD_END: "end of the forward", Phase.BACKWARD: "backward",
              Phase.BACKWARD_END: "end of the backward", Phase.DISPATCH: "dispatch", Phase.COMBINE: "combine",
              Phase.DISPATCH_BWD: "backward of dispatch", Phase.COMBINE_BWD: "backward of combine"}


class Failure(enum.IntEnum):
    NONE = 0
    REJECTED = 1  # an argument failed its check before any rows moved
    RAISED = 2    # an exception mid-call (expert_fn, side_fn, a kernel, the expert backward)


class ProtocolError(RuntimeError):
    """Ranks are not in the same call or phase (a skipped backward, layers called in another order), or
    a control row was not a moe_comm header. Raised on every rank of the exchange."""


# Fixed codes: two dtypes of one element size never share a code (e4m3 vs e5m2 would reinterpret bytes).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_DTYPES += tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                             "float8_e8m0fnu") if hasattr(torch, n))
_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    """Stable small int for ``dtype`` (ValueError for a dtype rows cannot travel as)."""
    if dtype not in _CODE:
        raise ValueError(f"rows of dtype {dtype} cannot be dispatched (supported: "
                         f"{', '.join(dtype_name(c) for c in _CODE.values())})")
    return _CODE[dtype]


def dtype_name(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 1 <= code <= len(_DTYPES) else f"<unknown {code}>"


_step = -1  # set_step: the training step of this process, carried by every control exchange
_STEP_MAX = (1 << 63) - 1  # the largest int64


def set_step(step: Optional[int]) -> None:
    """Tell moe_comm which training step this process is in (None: forget it). Every control exchange of
    every Dispatcher and MoELayer in the process then carries it, and every rank checks that all ranks are at
    the same step: a rank that skipped a whole step outside moe_comm (an exception caught by the training
    loop, a ``continue``) would otherwise pair its calls with its peers' calls of another step, unnoticed
    until a timeout at the end of the run. With it, every rank raises ``ProtocolError`` naming each rank's
    step in the first call where they differ. Call it on every rank at the top of each step (any counter
    that advances alike on every rank works: with gradient accumulation, a micro-batch counter also catches
    a skipped micro-batch)."""
    global _step
    if step is None:
        _step = -1
        return
    # The step travels as one int64 header word, -1 meaning unset: [0, 2**63 - 1] is what fits.
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _STEP_MAX:
        raise ValueError(f"set_step: step must be an int >= 0 or None, in [0, 2**63 - 1 = {_STEP_MAX}] (an int64 "
                         f"header word; None forgets it), got {step!r}")
    _step = step


def current_step() -> int:
    """The step ``set_step`` set, -1 when none is set."""
    return _step


def step_text(step: int) -> str:
    return "no step set" if step < 0 else f"step {step}"


def header(phase: Phase, *, dispatcher: int, call: int, chunks: int, experts: int, world: int,
           row_bytes: int = -1, dtype: int = -1, config: int = 0, failed: Failure = Failure.NONE,
           chunk: int = -1, top_k: int = -1) -> List[int]:
    """The host-known header words as [HEADER_WORDS] host ints (BAD_IDS, NONFINITE and ROWS are 0 here;
    device-computed counts are added on the device by the channel; STEP is ``current_step()``)."""
    # in Word order (a list display: 0.2 us; 17 item assignments by Word: 1.6 us)
    return [MAGIC, dispatcher, call, phase, chunks, experts, world, row_bytes, dtype, config, int(failed),
            0, 0, 0, chunk, top_k, _step]  # BAD_IDS, NONFINITE, ROWS: 0


def encode_message(text: Optional[str]) -> torch.Tensor:
    """UTF-8 text, cut to 256 bytes, as a CPU int64 [MESSAGE_WORDS] tensor (zeros: no message)."""
    data = (text or "").encode("utf-8", "replace")[:MESSAGE_WORDS * 8]
    buf = torch.zeros(MESSAGE_WORDS * 8, dtype=torch.uint8, device="cpu")  # host ints, whatever the default device
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.view(torch.int64)


def decode_message(words: Sequence[int]) -> str:
    raw = torch.tensor(list(words), dtype=torch.int64).view(torch.uint8).tolist()  # host sync: none, host ints
    return bytes(raw).rstrip(b"\0").decode("utf-8", "replace")


def describe_position(row: Sequence[int]) -> str:
    """'the backward of call 7 (dispatcher 0)' from a control row."""
    try:
        phase = PHASE_TEXT[Phase(row[Word.PHASE])]
    except ValueError:
        phase = f"phase {row[Word.PHASE]}"
    return f"the {phase} of call {row[Word.CALL]} (dispatcher {row[Word.DISPATCHER]})"


def positions(rows: List[Sequence[int]]) -> Dict[str, List[int]]:
    """position text -> ranks at it."""
    out: Dict[str, List[int]] = {}
    for r, row in enumerate(rows):
        out.setdefault(describe_position(row), []).append(r)
    return out
