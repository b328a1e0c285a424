"""How one fragment's round of outer gradients becomes one outer step (docs/design.md §1).

Pushes arrive one at a time and each is folded into a `RoundAccumulator` straight
from its frame's codes (`add_frame`: no float32 copy of the push), then dropped. When the round closes, `result()` is the merged outer gradient:
radial-directional averaging (RDA) for non-embedding tensors,

    Δ_t = (Σ w‖Δ_m,t‖ / Σ w) · unit(Σ w·unit(Δ_m,t)),

and a plain weighted average Σ wΔ_m,t / Σ w for embeddings. Independent learners'
outer gradients are nearly orthogonal, so a plain average shrinks as 1/√M; RDA keeps
the norm at the contributors' mean norm. `outer_step` then applies SGD with Nesterov
momentum (optax) to the fragment's global params.

Determinism: the shard replays its write-ahead log after a restart and must land on
the same bytes, so every sum here runs in a fixed order with no fused multiply-add:
norms are exact per 32-value block and summed in float64 in block order, then in the
codec's chunk order (`wire.codec.Codes.range_sq_norms`); the kernels run chunks on
threads, but the chunk grid is fixed by the format, so the same sequence of adds gives
the same bits on any number of threads. `add(delta)` and `add_frame(frame)` of a frame
that decodes to delta give the same bits too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
import optax

from atoll.server.config import OUTER_LR, OUTER_MOMENTUM, OUTER_MOMENTUM_DELAY
from atoll.wire import _kernels
from atoll.wire.codec import Codec, Codes, parallel, read_codes
from atoll.wire.plan import FragmentPlan, FragmentVector

OuterGrad = np.ndarray  # Θ_base − θ_learner over one fragment; points like a gradient
OuterState: TypeAlias = optax.OptState  # the outer optimiser's state for one fragment
Weight = float  # a push's merge weight, > 0: rules.token_weight × staleness discount

CHUNK = 1 << 16  # elements per pass of add_scaled: 256 KiB of float32 scratch stays in L2
# a pooled buffer's size is rounded up to this many values, so that fragments of nearly
# the same size (a plan's differ by a few rows) take each other's buffers: one taken new
# for a fragment a few hundred values larger than every kept one had its pages zeroed by
# the kernel again (the tail past a round's size is never touched, so never resident)
POOL_GRANULE = 1 << 16


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """A fragment vector's tensors: [offsets[i], ends[i]) and which merge as embeddings."""

    offsets: np.ndarray  # int64, first element of each tensor, ascending from 0
    ends: np.ndarray  # int64, one past each tensor's last element; ends[i] == offsets[i+1]
    embedding: np.ndarray  # bool, True: plain weighted average instead of RDA

    def __post_init__(self) -> None:
        o, e, emb = (
            np.asarray(self.offsets, np.int64),
            np.asarray(self.ends, np.int64),
            np.asarray(self.embedding, bool),
        )
        if o.ndim != 1 or not o.size or o.shape != e.shape or o.shape != emb.shape:
            raise ValueError(
                f"segments: offsets {o.shape}, ends {e.shape}, embedding "
                f"{emb.shape}: want three equal non-empty 1-D arrays"
            )
        if o[0] != 0 or np.any(e <= o) or np.any(o[1:] != e[:-1]):
            raise ValueError("segments must tile [0, size) with non-empty tensors in order")
        for name, a in (("offsets", o), ("ends", e), ("embedding", emb)):
            a.setflags(write=False)
            object.__setattr__(self, name, a)

    @classmethod
    def from_plan(cls, plan: FragmentPlan, fragment: int) -> Segments:
        """The tensors of one plan fragment, in layout order."""
        slots = plan.tensors_of(fragment)
        return cls(
            np.asarray([s.offset for s in slots], np.int64),
            np.asarray([s.end for s in slots], np.int64),
            np.asarray([bool(s.spec.embedding) for s in slots], bool),
        )

    @classmethod
    def from_sizes(cls, sizes: npt.ArrayLike, embedding: npt.ArrayLike | None = None) -> Segments:
        """Contiguous tensors of the given sizes (embedding: per-tensor flags, default none)."""
        ends = np.cumsum(np.asarray(sizes, np.int64))
        emb = np.zeros(len(ends), bool) if embedding is None else np.asarray(embedding, bool)
        return cls(np.concatenate([[0], ends[:-1]]), ends, emb)

    @property
    def size(self) -> int:
        return int(self.ends[-1])

    def __len__(self) -> int:
        return len(self.offsets)

    def same_as(self, other: Segments) -> bool:
        return all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("offsets", "ends", "embedding")
        )


def segment_norms(vec: np.ndarray, seg: Segments, *, finite: bool = False) -> np.ndarray:
    """Per-tensor L2 norms (float64) of a finite float32 vector, in the codec's fixed order.

    Not BLAS or einsum: their summation order may change with threads or the CPU.
    `finite=True`: the caller knows vec is finite (the check's pass over it is skipped)."""
    codes = Codes.of_values(vec, finite=finite)
    sq_norms: npt.NDArray[np.float64] = codes.range_sq_norms(seg.offsets, seg.ends)
    return np.sqrt(sq_norms)


def add_scaled(
    acc: np.ndarray,
    vec: np.ndarray,
    seg: Segments,
    scales: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """acc[t] += float32(scales[t]) · vec[t] for every tensor t, in place; 0 scales skip.

    The plain numpy statement of what `RoundAccumulator` adds; its kernel
    (`Codes.accumulate_ranges`) is tested against this bit for bit."""
    scratch = np.empty(CHUNK, np.float32) if scratch is None else scratch
    s32 = np.asarray(scales, np.float64).astype(np.float32)
    for o, e, s in zip(seg.offsets.tolist(), seg.ends.tolist(), s32):
        if s == 0:
            continue
        for a in range(o, e, CHUNK):
            b = min(a + CHUNK, e)
            t = scratch[: b - a]
            np.multiply(vec[a:b], s, out=t)  # multiply, then add: never fused
            np.add(acc[a:b], t, out=acc[a:b])


_F32_MAX = float(np.finfo(np.float32).max)


def _weight(weight: Weight) -> float:
    w = float(weight)
    if not (np.isfinite(w) and w > 0):
        raise ValueError(f"weight {weight!r}: want a finite number > 0")
    return w


def _checked_codes(frame: bytes | Codes, codec: Codec | None, size: int) -> Codes:
    if isinstance(frame, Codes):
        if codec is not None and frame.info.codec != Codec(codec):
            raise ValueError(f"frame uses {frame.info.codec.name}; expected {Codec(codec).name}")
        if frame.num_values != size:
            raise ValueError(f"frame holds {frame.num_values} values; the fragment holds {size}")
        return frame
    return read_codes(frame, codec=codec, num_values=size)


class AccumulatorSnapshot(NamedTuple):
    """A `RoundAccumulator`'s open round as a snapshot: arrays and scalars only (np.savez-able)."""

    offsets: np.ndarray  # int64 [T]
    ends: np.ndarray  # int64 [T]
    embedding: np.ndarray  # bool [T]
    acc: np.ndarray  # float32 [size]: Σ w·unit(Δ) (RDA tensors) or Σ w·Δ (the rest)
    norm_sum: np.ndarray  # float64 [T]: Σ w·‖Δ_t‖
    total_weight: float  # Σ w
    count: int  # type: ignore[assignment]  # shadows tuple.count; contributions so far
    rda: bool  # False: plain weighted average everywhere


def _pooled_size(size: int) -> int:
    """The values of a buffer the pool makes for `size` (rounded up to POOL_GRANULE)."""
    return size if size < POOL_GRANULE else -(-size // POOL_GRANULE) * POOL_GRANULE


class AccumulatorPool:
    """Round accumulators that closed rounds let go, for the next rounds' first pushes.

    A fresh buffer's pages are faulted in and zeroed by the kernel as the round's first
    push is written into it (measured: ~12 % of a shard's CPU while it ingests); a
    buffer a close gave back is written over instead. Buffers are kept only while some
    round that took one is still open, and the last such round to close or be dropped
    lets every kept buffer go. Each buffer taken new replaces a kept one too small for
    it, so the pool never holds more buffers than were out at its busiest moment: the
    memory the open rounds held then, and nothing between rounds.

    Example:
      >>> pool = AccumulatorPool()
      >>> a = pool.take(4); b = pool.take(3)
      >>> pool.give(a); pool.kept
      1
      >>> pool.take(2).base is a.base  # a kept buffer big enough is reused
      True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[np.ndarray] = []  # whole buffers, given back while rounds are out
        self._out: dict[
            int, weakref.finalize[[int], np.ndarray]
        ] = {}  # id(taken view) -> its drop callback
        # ids of views let go unsettled: the callback only appends (the collector may run it
        # on any thread at any allocation, this pool's own locked ones included), and the
        # next call under the lock settles them, always before a new view's id is entered
        # (a dead view's id can only be reused after its callback ran)
        self._gone: collections.deque[int] = collections.deque()

    @property
    def kept(self) -> int:
        """Buffers held for reuse now."""
        with self._lock:
            self._reap()
            return len(self._kept)

    def take(self, size: int) -> np.ndarray:
        """A float32 vector of `size` values with undefined contents (write all of it)."""
        with self._lock:
            self._reap()
            fits = [i for i, b in enumerate(self._kept) if b.size >= size]
            if fits:
                buf = self._kept.pop(min(fits, key=lambda i: self._kept[i].size))
            else:
                if self._kept:  # a new buffer stands in for a kept one too small
                    self._kept.pop(max(range(len(self._kept)), key=lambda i: self._kept[i].size))
                buf = np.empty(_pooled_size(size), np.float32)
            view = buf[:size]
            self._reap()  # a view dropped meanwhile may have had this id
            self._out[id(view)] = weakref.finalize(view, self._dropped, id(view))
        return view

    def give(self, view: np.ndarray) -> None:
        """Hands back a buffer from `take` that nothing reads or writes any more."""
        self._settle(view, keep=True)

    def keep(self, view: np.ndarray) -> None:
        """A buffer from `take` stays with its taker for good (never reused)."""
        self._settle(view, keep=False)

    def _settle(self, view: np.ndarray, keep: bool) -> None:
        with self._lock:
            self._reap()
            ticket = self._out.pop(id(view), None)
            assert ticket is not None, "a buffer this pool did not lend, or settled twice"
            ticket.detach()
            if keep and self._out:
                self._kept.append(view.base if view.base is not None else view)
            elif not self._out:
                self._kept.clear()

    def _dropped(self, key: int) -> None:  # a taken buffer was let go unsettled
        self._gone.append(key)

    def _reap(self) -> None:  # under the lock
        while self._gone:
            self._out.pop(self._gone.popleft(), None)
        if not self._out:
            self._kept.clear()


class RoundAccumulator:
    """Streams one round's weighted outer gradients for one fragment.

    Memory: one float32 vector the size of the fragment while the round is open (float32
    because it is the largest object a shard holds per open round and Σ w·unit(Δ) needs
    no more: each term is already normalised; allocated by the round's first push and let
    go by `reset`, so a fragment between rounds holds none) and float64 per-tensor sums.
    A push is read from its frame's decompressed codes (~0.56 bytes per INT4 value),
    never as float32.

    Example:
      >>> seg = Segments.from_sizes([3, 2], embedding=[False, True])
      >>> acc = RoundAccumulator(seg)
      >>> acc.add(np.array([3, 4, 0, 1, 1], np.float32), 1.0)
      >>> acc.add(np.array([0, 0, 5, 3, 3], np.float32), 1.0)
      >>> acc.result().astype(float).round(3).tolist()  # RDA: norm 5, not 3.54
      [2.121, 2.828, 3.536, 2.0, 2.0]
    """

    def __init__(
        self, segments: Segments, *, rda: bool = True, pool: AccumulatorPool | None = None
    ):
        self.segments = segments
        self.rda = bool(rda)
        self.pool = pool  # where the accumulator comes from and goes back to (None: np.empty)
        # Tensors merged by RDA; with rda=False every tensor is a plain average.
        self._rda_mask = ~segments.embedding if self.rda else np.zeros(len(segments), bool)
        self._acc: np.ndarray | None = None  # Σ w·unit(Δ): allocated by the round's first push
        self._norm_sum = np.empty(len(segments), np.float64)
        self.reset()

    def reset(self) -> None:
        """Empties the round and lets its accumulator go (back to the pool, if any)."""
        if self._acc is not None and self.pool is not None:
            self.pool.give(self._acc)
        self._acc = None
        self._norm_sum.fill(0)
        self.total_weight = 0.0  # Σ w, float64
        self.count = 0  # contributions so far

    def add(self, delta: OuterGrad, weight: Weight) -> None:
        """Folds in one learner's outer gradient; refuses bad input without changing state.

        The same as `add_frame` of a frame that decodes to delta, bit for bit."""
        delta = np.asarray(delta)
        if delta.dtype != np.float32 or delta.shape != (self.segments.size,):
            raise ValueError(
                f"delta {delta.dtype}{delta.shape}: want float32 "
                f"({self.segments.size},), the fragment's flat vector"
            )
        w = _weight(weight)
        self._add(Codes.of_values(delta), w)  # CodecError (a ValueError) on NaN/Inf

    def add_frame(self, frame: bytes | Codes, weight: Weight, codec: Codec | None = None) -> None:
        """Folds in one learner's outer gradient straight from its frame, with no float32 copy.

        Args:
          frame: the push's frame bytes, or its `read_codes` (already checked).
          weight: the merge weight w > 0.
          codec: when given, the frame must use this codec.

        Raises:
          ValueError: a bad weight. CodecError (a ValueError): a malformed frame, one of
            another size or codec, or one whose terms would overflow the float32
            accumulator. Either way the round is unchanged.
        """
        w = _weight(weight)
        self._add(_checked_codes(frame, codec, self.segments.size), w)

    def _add(self, codes: Codes, w: float) -> None:
        seg, rda = self.segments, self._rda_mask
        norms = np.sqrt(codes.range_sq_norms(seg.offsets, seg.ends))  # float64: never overflows
        scales = np.full(len(norms), w)
        with np.errstate(divide="ignore", over="ignore"):
            unit = w / norms[rda]
        # A zero norm has no direction; nor has one so small that w/‖Δ‖ is beyond float32
        # (denormal-sized values only): both add their weight and no direction.
        scales[rda] = np.where(unit <= _F32_MAX, unit, 0.0)
        # the round's first push is written straight into its accumulator (no zeros read)
        acc, first = self._acc, self._acc is None
        if acc is None:  # every range is written below: a reused buffer's old bits go
            acc = np.empty(seg.size, np.float32) if self.pool is None else self.pool.take(seg.size)
        codes.accumulate_ranges(
            acc, seg.offsets, seg.ends, scales, add=not first
        )  # checks, then writes
        self._acc = acc
        self._norm_sum[rda] += w * norms[rda]
        self.total_weight += w
        self.count += 1

    def result(self) -> FragmentVector:
        """The merged outer gradient as a fresh float32 vector; the round stays open."""
        return self._merged(in_place=False)

    def take(self) -> FragmentVector:
        """The merged outer gradient, the same bits as `result`, written over the
        accumulator's own buffer (a close needs no second one); the round is then empty.
        With a pool, the caller owns the buffer: `pool.give` or `pool.keep` it."""
        out = self._merged(in_place=True)
        self._acc = None
        self.reset()
        return out

    def _merged(self, in_place: bool) -> FragmentVector:
        if self.count == 0:
            raise ValueError("empty round: add() at least one contribution before result()")
        rda, W = self._rda_mask, self.total_weight
        assert self._acc is not None  # count > 0
        dir_norms = segment_norms(
            self._acc, self.segments, finite=True
        )  # sums that never overflowed
        with np.errstate(divide="ignore", invalid="ignore"):
            scales = np.where(
                rda, np.where(dir_norms > 0, self._norm_sum / W / dir_norms, 0.0), 1.0 / W
            )
        out = self._acc if in_place else np.empty(self._acc.size, np.float32)
        for o, e, sc in zip(
            self.segments.offsets.tolist(), self.segments.ends.tolist(), scales.astype(np.float32)
        ):
            np.multiply(self._acc[o:e], sc, out=out[o:e])
        return out

    def state(self) -> AccumulatorSnapshot:
        """A copy of the open round, for a shard snapshot (an empty `acc` when no push is in)."""
        s = self.segments
        return AccumulatorSnapshot(
            s.offsets.copy(),
            s.ends.copy(),
            s.embedding.copy(),
            np.zeros(0, np.float32) if self._acc is None else self._acc.copy(),
            self._norm_sum.copy(),
            float(self.total_weight),
            int(self.count),
            self.rda,
        )

    @classmethod
    def from_state(
        cls,
        state: AccumulatorSnapshot,
        segments: Segments | None = None,
        pool: AccumulatorPool | None = None,
    ) -> RoundAccumulator:
        """Resumes a round from `state()`; checks it against `segments` when given; its
        accumulators come from `pool`."""
        st = AccumulatorSnapshot(*state)
        saved = Segments(st.offsets, st.ends, st.embedding)
        if segments is not None and not segments.same_as(saved):
            raise ValueError(
                "round snapshot was taken with a different fragment layout; "
                "resume it with the plan it was made with"
            )
        acc, norm_sum = np.asarray(st.acc), np.asarray(st.norm_sum)
        empty = acc.shape == (0,) and int(st.count) == 0  # no push in: no accumulator saved
        if (
            acc.dtype != np.float32
            or (acc.shape != (saved.size,) and not empty)
            or norm_sum.shape != (len(saved),)
        ):
            raise ValueError(
                f"round snapshot arrays acc {acc.dtype}{acc.shape}, norm_sum "
                f"{norm_sum.shape} do not fit {len(saved)} tensors / {saved.size}"
            )
        out = cls(segments if segments is not None else saved, rda=bool(st.rda), pool=pool)
        if not empty:
            out._acc = np.empty(saved.size, np.float32) if pool is None else pool.take(saved.size)
            out._acc[:] = acc
        out._norm_sum[:] = norm_sum.astype(np.float64)
        out.total_weight, out.count = float(st.total_weight), int(st.count)
        return out


@dataclasses.dataclass(frozen=True)
class OuterOptimizer:
    """SGD with Nesterov momentum, the outer optimiser (docs/design.md §1 defaults); with
    `delay` N > 1, delayed Nesterov (see `delayed_nesterov`).

    `outer_step` runs it in one pass of a C kernel on every core, bit for bit the XLA
    program of `reference` (optax's Nesterov for N = 1, `delayed_nesterov` after it);
    its state has `reference`'s layout, so snapshots read the same either way."""

    lr: float = OUTER_LR
    momentum: float = OUTER_MOMENTUM
    delay: int = OUTER_MOMENTUM_DELAY

    def __post_init__(self) -> None:
        lr, momentum, delay = self.lr, self.momentum, self.delay
        if not lr > 0 or not 0 <= momentum < 1 or not (isinstance(delay, int) and delay >= 1):
            raise ValueError(
                f"lr={lr}, momentum={momentum}, delay={delay}: want lr > 0, 0 <= momentum < 1 "
                "and an integer delay >= 1"
            )

    @property
    def reference(self) -> optax.GradientTransformation:
        """The same optimiser as an optax transformation (run by XLA)."""
        if self.delay == 1:
            return optax.sgd(learning_rate=self.lr, momentum=self.momentum, nesterov=True)
        return delayed_nesterov(self.lr, self.momentum, self.delay)

    def init(self, params: npt.ArrayLike) -> OuterState:
        """Zero momentum (and round counter), as numpy arrays in `reference`'s layout."""
        state = self.reference.init(jnp.zeros_like(jnp.asarray(params, jnp.float32)))
        return jax.tree_util.tree_map(np.array, state)  # copies: numpy's own, writable


def outer_optimizer(
    lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM, delay: int = OUTER_MOMENTUM_DELAY
) -> OuterOptimizer:
    """The outer optimiser (see `OuterOptimizer`); N = 1 is optax's Nesterov."""
    return OuterOptimizer(lr, momentum, delay)


class DelayedNesterovState(NamedTuple):
    """The outer optimiser's state under delayed Nesterov."""

    rounds: jax.Array | np.ndarray  # rounds since the momentum's last full update (int32 scalar)
    momentum: jax.Array | np.ndarray  # m, with those rounds' gradients already folded in (÷ delay)


def delayed_nesterov(lr: float, momentum: float, delay: int) -> optax.GradientTransformation:
    """Delayed Nesterov momentum (Asynchronous Local-SGD, arXiv 2401.09135, §4.1).

    Every round takes a plain step, θ ← θ − η·g; every `delay`-th round the momentum
    also moves, once, with the mean of the rounds it skipped: m ← β·m + ḡ, and the
    step gains −η·β·m. With delay 1 that is Nesterov exactly (g + β·m with the new m,
    optax's form, bit for bit). Momentum built from stale outer gradients is what makes
    asynchronous rounds overshoot; updating it N times less often keeps its gain on a
    stale round to 1/N while fresh rounds still move the model a full step each.

    The plain steps never read m, so each round folds g/N into it at once (β·m + g/N on
    the first round of a cycle, + g/N after): no buffer of skipped gradients, and the
    state is as large as Nesterov's (one float32 per parameter, plus a counter).
    """
    if not (isinstance(delay, int) and delay >= 1):
        raise ValueError(f"delay={delay}: want an integer >= 1")
    beta = float(momentum)

    def init(params: jax.Array) -> DelayedNesterovState:
        return DelayedNesterovState(jnp.zeros([], jnp.int32), jnp.zeros_like(jnp.asarray(params)))

    def update(
        grads: jax.Array, state: DelayedNesterovState, params: jax.Array | None = None
    ) -> tuple[jax.Array, DelayedNesterovState]:
        del params
        share = grads / delay
        m = jnp.where(state.rounds == 0, beta * state.momentum + share, state.momentum + share)
        rounds = state.rounds + 1
        due = rounds >= delay
        step = jnp.where(due, grads + beta * m, grads)
        return -lr * step, DelayedNesterovState(jnp.where(due, 0, rounds).astype(jnp.int32), m)

    return optax.GradientTransformation(init, update)


@functools.partial(jax.jit, static_argnums=3)
def _step(
    params: jax.Array, opt_state: OuterState, grad: jax.Array, opt: optax.GradientTransformation
) -> tuple[jax.Array, OuterState]:
    updates, new_state = opt.update(grad, opt_state, params)
    return optax.apply_updates(params, updates), new_state


STEP_CHUNK = 1 << 20  # values per kernel call: items for every core, each a few MB


def _momentum_and_rounds(
    state: OuterState, size: int
) -> tuple[np.ndarray, int, Any, list[np.ndarray]]:
    """The momentum vector and round counter in `state` (optax's Nesterov: no counter)."""
    leaves, treedef = jax.tree_util.tree_flatten(state)
    leaves = [np.asarray(leaf) for leaf in leaves]
    if isinstance(state, DelayedNesterovState):
        return leaves[1], int(leaves[0]), treedef, leaves
    vectors = [i for i, leaf in enumerate(leaves) if leaf.shape == (size,)]
    if len(vectors) != 1:
        raise ValueError(f"outer state with {len(leaves)} arrays: want one momentum vector")
    return leaves[vectors[0]], 0, treedef, leaves


def outer_step(
    params: FragmentVector,
    opt_state: OuterState,
    outer_grad: OuterGrad,
    opt: OuterOptimizer | optax.GradientTransformation,
    *,
    in_place: bool = False,
) -> tuple[FragmentVector, OuterState]:
    """One outer step: params − lr·(Nesterov-momentum Δ); pure and bit-deterministic.

    Args:
      params: the fragment's global params Θ, flat float32.
      opt_state: `opt.init(params)` or the previous step's state.
      outer_grad: merged Δ = Θ_base − θ_learner (points like a gradient: uphill).
      opt: usually `outer_optimizer()`, run by the C kernel in one pass; an optax
        transformation runs through XLA instead (one jit compile per (opt, size)).
      in_place: write the new params and momentum over the old ones (an `OuterOptimizer`
        and writable float32 params and momentum only): for a caller that knows nobody
        else reads them. The same bits either way.

    Returns:
      (new params, new optimiser state); fresh arrays, the inputs not written, unless
      `in_place`.

    Example:
      >>> opt = outer_optimizer(lr=1.0, momentum=0.0)
      >>> theta = np.ones(3, np.float32)
      >>> outer_step(theta, opt.init(theta), np.full(3, 0.25, np.float32), opt)[0].tolist()
      [0.75, 0.75, 0.75]
    """
    p, g = np.asarray(params, np.float32), np.asarray(outer_grad, np.float32)
    if p.shape != g.shape or p.ndim != 1:
        raise ValueError(f"params {p.shape} and outer_grad {g.shape}: want equal 1-D shapes")
    if not isinstance(opt, OuterOptimizer):
        if in_place:
            raise ValueError("in_place takes an OuterOptimizer (the C kernel)")
        # device_put adopts aligned inputs without copying; the params come back as a view
        # of XLA's own (aligned) buffer.
        xla_p, xla_state = _step(jax.device_put(p), opt_state, jax.device_put(g), opt)
        return np.asarray(xla_p), xla_state
    m, rounds, treedef, leaves = _momentum_and_rounds(opt_state, p.size)
    if m.shape != p.shape or m.dtype != np.float32:
        raise ValueError(f"momentum {m.dtype}{m.shape} does not fit params {p.shape}")
    first, due = rounds == 0, rounds + 1 >= opt.delay
    if in_place:
        if not (p.flags.writeable and m.flags.writeable and p is params):
            raise ValueError("in_place needs writable float32 params and momentum")
        new_p, new_m = p, m  # each value is read before it is written, at the same index
    else:
        new_p, new_m = np.empty_like(p), np.empty_like(m)

    def run(i: int) -> None:
        a, b = i * STEP_CHUNK, min((i + 1) * STEP_CHUNK, p.size)
        _kernels.outer_step(
            p[a:b], g[a:b], m[a:b], new_p[a:b], new_m[a:b],
            opt.lr, opt.momentum, opt.delay, first, due,
        )  # fmt: skip

    parallel(run, -(-p.size // STEP_CHUNK))
    if isinstance(opt_state, DelayedNesterovState):
        new_state: OuterState = DelayedNesterovState(
            np.array(0 if due else rounds + 1, np.int32), new_m
        )
    else:
        new_state = jax.tree_util.tree_unflatten(
            treedef, [new_m if leaf is m else leaf for leaf in leaves]
        )
    return new_p, new_state
