# Types for the C extension wire/_kernels.c (see its docstrings). Buffers are any object
# with the buffer protocol (bytes, memoryview, numpy arrays); typing.Buffer cannot name
# numpy arrays under Python 3.11, so they are typed `object`.
from typing import TypeAlias

_Buffer: TypeAlias = object

INT4: int
MXFP4: int
FP32: int
BLOCK: int

def encode(
    fmt: int,
    x: _Buffer,
    residual: _Buffer | None,
    residual_out: _Buffer | None,
    body: _Buffer,
    publish: bool = False,
    /,
) -> int: ...
def check(fmt: int, scales: _Buffer, codes: _Buffer, count: int, /) -> int: ...
def decode(
    fmt: int, scales: _Buffer, codes: _Buffer, out: _Buffer, weight: float, accumulate: bool, /
) -> None: ...
def range_stats(
    fmt: int,
    scales: _Buffer,
    codes: _Buffer,
    count: int,
    start: int,
    offsets: _Buffer,
    ends: _Buffer,
    sq: _Buffer | None,
    max_abs: _Buffer | None,
    exact: bool,
    known: _Buffer | None = None,
    /,
) -> None: ...
def accumulate(
    fmt: int,
    scales: _Buffer,
    codes: _Buffer,
    count: int,
    start: int,
    offsets: _Buffer,
    ends: _Buffer,
    weights: _Buffer,
    out: _Buffer,
    check: bool,
    add: bool = True,
    /,
) -> int: ...
def decode_runs(
    fmt: int,
    scales: _Buffer,
    codes: _Buffer,
    count: int,
    start: int,
    src: _Buffer,
    dst: _Buffer,
    lengths: _Buffer,
    out: _Buffer,
    known: _Buffer | None = None,
    skip_known: bool = False,
    /,
) -> None: ...
def accumulate_runs(
    fmt: int,
    scales: _Buffer,
    codes: _Buffer,
    count: int,
    start: int,
    src: _Buffer,
    dst: _Buffer,
    lengths: _Buffer,
    weights: _Buffer,
    out: _Buffer,
    add: bool,
    /,
) -> None: ...
def outer_step(
    params: _Buffer,
    grad: _Buffer,
    momentum: _Buffer,
    params_out: _Buffer,
    momentum_out: _Buffer,
    lr: float,
    beta: float,
    delay: int,
    first: bool,
    due: bool,
    /,
) -> None: ...
