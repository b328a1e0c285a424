"""The inner loop: AdamW steps, data-parallel over every local device.

A learner is a whole island (docs/design.md §4): the batch is sharded over a 1-D mesh of
`jax.devices()` (axis "data") and parameters and optimiser state are replicated, so
XLA all-reduces the gradients inside the island; or, with `fsdp`, parameters and their
optimiser state are split over the mesh's "fsdp" axis (learner/trainer/mesh.py). The same code
runs on one CPU, on `XLA_FLAGS=--xla_force_host_platform_device_count=4`, or on a
TPU/GPU host.

The sync client drives a `Trainer` one step at a time and swaps parameters between
steps (adopting new global fragments); the inner optimiser state carries on across
those swaps, as in DiLoCo.

On a multi-host slice (learner/distributed.py) the mesh spans every process's
devices; each process hands in only the rows of the global batch that its own devices
hold (`jax.make_array_from_process_local_data`), and parameters are placed from the same
host values on every process, each process placing its own devices' parts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from atoll.learner.trainer.data import eval_batches
from atoll.learner.trainer.mesh import (
    DATA_AXIS,
    Placement,
    batch_spec,
    island_mesh,
    param_shardings,
    placement,
    state_shardings,
)
from atoll.learner.trainer.model import ModelConfig, Params, init_params, loss_fn

OptState = Any  # optax state pytree
Step = Any  # a jitted step (jax.jit's wrapper); called, lowered, compiled
# jax ships these untyped: typed names for them keep the calls below checked
_spec: Callable[..., PartitionSpec] = PartitionSpec
_from_local_data: Callable[..., jax.Array] = jax.make_array_from_process_local_data
_shape_dtype: Callable[..., Any] = jax.ShapeDtypeStruct
Metrics = dict[str, float]


class TrainConfigError(ValueError):
    """A training setting that cannot work; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16  # sequences per step, all local devices; a multiple of their count
    peak_lr: float = 3e-3  # AdamW learning rate after warm-up, > 0
    warmup_steps: int = 50  # linear warm-up from 0 to peak_lr, in [0, total_steps)
    total_steps: int = 5000  # end of the cosine decay (warm-up included); lr then stays put
    end_lr_fraction: float = 0.1  # final lr as a fraction of peak_lr, in [0, 1]
    weight_decay: float = 0.1  # decoupled decay on matrices (not norm scales), >= 0
    b1: float = 0.9  # Adam first-moment decay, in [0, 1)
    b2: float = 0.95  # Adam second-moment decay, in [0, 1)
    eps: float = 1e-8  # Adam denominator epsilon, > 0
    grad_clip: float = 1.0  # max global gradient norm, > 0; 0 disables clipping
    eval_every: int = 100  # steps between held-out evaluations, >= 0; 0 disables
    eval_batches: int = 8  # held-out batches per evaluation, >= 1
    seed: int = 0  # parameter init (data order takes its own seed), any int

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise TrainConfigError(message)

        for field in ("batch_size", "total_steps", "eval_batches"):
            value = getattr(self, field)
            need(
                isinstance(value, int) and value >= 1, f"{field} must be an int >= 1, got {value!r}"
            )
        need(
            isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps < self.total_steps,
            f"warmup_steps must be in [0, total_steps={self.total_steps}), got "
            f"{self.warmup_steps}; lower it or raise total_steps",
        )
        need(
            self.peak_lr > 0 and math.isfinite(self.peak_lr),
            f"peak_lr must be a finite number > 0, got {self.peak_lr}",
        )
        need(
            0 <= self.end_lr_fraction <= 1,
            f"end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}",
        )
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(
            0 <= self.b1 < 1 and 0 <= self.b2 < 1,
            f"b1 and b2 must be in [0, 1), got {self.b1}, {self.b2}",
        )
        need(self.eps > 0, f"eps must be > 0, got {self.eps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 disables it), got {self.grad_clip}")
        need(
            isinstance(self.eval_every, int) and self.eval_every >= 0,
            f"eval_every must be an int >= 0 (0 disables evaluation), got {self.eval_every!r}",
        )


def make_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warm-up to peak_lr, then cosine decay to end_lr_fraction * peak_lr."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.peak_lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,
        end_value=cfg.peak_lr * cfg.end_lr_fraction,
    )


def lr_at(cfg: TrainConfig, step: int) -> float:
    """make_schedule(cfg)(step) in plain Python (for metrics: no jax dispatch or compile)."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * step / cfg.warmup_steps
    end = cfg.peak_lr * cfg.end_lr_fraction
    progress = min(step - cfg.warmup_steps, cfg.total_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress / (cfg.total_steps - cfg.warmup_steps)))
    return end + (cfg.peak_lr - end) * cosine


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (no weight decay on 1-D norm scales)."""
    adamw = optax.adamw(
        make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    if cfg.grad_clip == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)


def data_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over `devices` (default: all of `jax.devices()`), axis "data"."""
    return Mesh(np.asarray(devices if devices is not None else jax.devices()), (DATA_AXIS,))


def make_train_step(
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    where: Placement | None = None,
) -> Step:
    """The jitted `(params, opt_state, batch_BxL1) -> (params, opt_state, metrics)`.

    batch_BxL1 is sharded over every device of the mesh; params are placed `where`
    (learner/trainer/mesh.py; default: replicated), the optimiser state like its params, metrics
    replicated. metrics: {"loss", "grad_norm"} (grad norm before clipping).
    """
    replicated = NamedSharding(mesh, _spec())
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    params_in: Any = replicated if where is None else param_shardings(where, mesh)
    state_in: Any = replicated if where is None else state_shardings(optimizer, where, mesh)

    def step(
        params: Params, opt_state: OptState, batch_BxL1: jax.Array
    ) -> tuple[Params, OptState, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxL1, model_cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(
        step,
        in_shardings=(params_in, state_in, batch_sharding),
        out_shardings=(params_in, state_in, replicated),
    )


def make_eval_step(model_cfg: ModelConfig, mesh: Mesh, where: Placement | None = None) -> Step:
    """The jitted `(params, batch_BxL1) -> mean loss`, params and batch placed as in
    training."""
    params_in: Any = NamedSharding(mesh, _spec()) if where is None else param_shardings(where, mesh)
    return jax.jit(
        lambda params, batch: loss_fn(params, batch, model_cfg),
        in_shardings=(params_in, NamedSharding(mesh, batch_spec(mesh))),
    )


@functools.lru_cache(maxsize=16)
def _cached_train_step(
    model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, where: Placement | None = None
) -> Step:
    """One jit object per (configs, mesh, placement): a second Trainer alike reuses its
    compilation."""
    return make_train_step(model_cfg, make_optimizer(train_cfg), mesh, where)


@functools.lru_cache(maxsize=16)
def _cached_eval_step(model_cfg: ModelConfig, mesh: Mesh, where: Placement | None = None) -> Step:
    return make_eval_step(model_cfg, mesh, where)


def evaluate(
    params: Params,
    batches: Sequence[np.ndarray],
    model_cfg: ModelConfig,
    mesh: Mesh | None = None,
    *,
    _eval_step: Step = None,
) -> Metrics:
    """Mean held-out loss over `batches`, in nats and in bits per byte (loss / ln 2).

    Every batch must have the same number of rows, a multiple of the mesh's devices.

    Example:
      >>> evaluate(params, eval_batches(corpus.heldout, context=128, batch_size=16,
      ...                               num_batches=8), PRESETS["small"])
      {'loss': 1.93, 'bits_per_byte': 2.78}
    """
    if not batches:
        raise ValueError("evaluate() needs at least one batch")
    mesh = mesh if mesh is not None else data_mesh()
    eval_step = _eval_step or _cached_eval_step(model_cfg, mesh)
    _check_rows(len(batches[0]), mesh)
    batch_sharding = NamedSharding(mesh, batch_spec(mesh))
    losses = [eval_step(params, global_batch(b, batch_sharding)) for b in batches]
    loss = float(np.mean([float(x) for x in losses]))
    return {"loss": loss, "bits_per_byte": loss / math.log(2)}


def _check_rows(rows: int, mesh: Mesh) -> None:
    if rows % mesh.size:
        raise TrainConfigError(
            f"batch_size {rows} is not divisible by the {mesh.size} local devices; use a "
            f"multiple of {mesh.size} (e.g. {mesh.size * max(1, round(rows / mesh.size))})"
        )


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """x placed on the devices of `sharding` (replicated or split).

    On several processes each passes the same host value and places only its own
    devices' parts (device_put cannot reach another process's devices).
    """
    if isinstance(x, jax.Array) or sharding.is_fully_addressable:
        placed: jax.Array = jax.device_put(x, sharding)
        return placed
    return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])


def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a batch of `shape`, split by `sharding`, that this process's devices hold."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(shape).values():
        assert index is not None  # a device of the sharding holds a part
        rows = index[0]
        starts.append(rows.start or 0)
        stops.append(shape[0] if rows.stop is None else rows.stop)
    start, stop = min(starts), max(stops)
    # A 1-D mesh in device order gives each process one contiguous block of rows.
    assert sum(b - a for a, b in zip(starts, stops)) == stop - start, "non-contiguous local rows"
    return slice(start, stop)


def global_batch(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The whole batch as one array over the mesh; each process contributes its own rows."""
    batch = np.asarray(batch).astype(np.int32, copy=False)
    if sharding.is_fully_addressable:
        placed: jax.Array = jax.device_put(batch, sharding)
        return placed
    rows = local_rows(sharding, batch.shape)
    return _from_local_data(sharding, batch[rows], batch.shape)


def _f32(x: Any) -> Any:
    """float32 without a round trip: jax arrays stay on device, the rest go via a numpy
    copy of our own (the CPU client adopts a suitably aligned host array instead of
    copying it, so handing it the caller's buffer would alias it)."""
    return x.astype(jnp.float32) if isinstance(x, jax.Array) else np.array(x, np.float32, copy=True)


class BatchSource(Protocol):
    """`source[step]` -> int (batch_size, context + 1) array; `data.Batches` is one.

    A source with `rows(step, slice)` (Batches) lets each process of a multi-host
    learner read only its own rows.
    """

    def __getitem__(self, step: int) -> np.ndarray: ...


class Trainer:
    """Holds params, optimiser state and the step count; `step()` runs one inner step.

    The sync client, between steps:
      * reads `trainer.params` (jax arrays, replicated or split by `fsdp`);
      * swaps in new global weights with `trainer.params = tree` (same names and
        shapes; numpy or jax leaves) or just some tensors with
        `trainer.set_tensors(plan.unflatten_fragment(p, vector))`.
    The optimiser state is kept across swaps. `snapshot()` / `restore()` save and
    resume everything (host copies, with the configs they were made with).

    Example:
      >>> corpus = load_corpus()
      >>> cfg, tcfg = PRESETS["small"], TrainConfig()
      >>> trainer = Trainer(cfg, tcfg, Batches(corpus.train, context=cfg.context,
      ...                   batch_size=tcfg.batch_size, learner=0, num_learners=4),
      ...                   heldout=corpus.heldout)
      >>> trainer.step()["loss"]
      5.61
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        batches: BatchSource,
        *,
        params: Params | None = None,
        heldout: np.ndarray | None = None,
        slowdown: float = 1.0,
        devices: Sequence[jax.Device] | None = None,
        fsdp: int = 1,
    ):
        """Places params and optimiser state on the mesh; compiles on the first step.

        Args:
          model_cfg, train_cfg: the model shape and the inner optimiser settings.
          batches: batch source indexed by step (e.g. `data.Batches` of this learner).
          params: initial parameters; default `init_params(model_cfg, train_cfg.seed)`.
          heldout: held-out token stream; if given, `step()` evaluates every
            train_cfg.eval_every steps on fixed batches from it.
          slowdown: >= 1; each step sleeps so it lasts slowdown x its measured time
            (emulates an older accelerator generation).
          devices: the island's devices (default all of `jax.devices()`).
          fsdp: split params (and their optimiser state) this many ways over the mesh's
            "fsdp" axis; 1: replicated; 0: over every device (learner/trainer/mesh.py).
        """
        if not (isinstance(slowdown, (int, float)) and slowdown >= 1 and math.isfinite(slowdown)):
            raise TrainConfigError(
                f"slowdown must be a finite number >= 1 (1 = full speed), got {slowdown!r}"
            )
        self.model_cfg, self.train_cfg, self.slowdown = model_cfg, train_cfg, float(slowdown)
        # the slowdown's wait; a learner makes it end on its stop
        self.sleep: Callable[[float], object] = time.sleep
        self.mesh = island_mesh(devices, fsdp)
        _check_rows(train_cfg.batch_size, self.mesh)
        self._batch_sharding = NamedSharding(self.mesh, batch_spec(self.mesh))
        self.schedule = make_schedule(train_cfg)
        self.optimizer = make_optimizer(train_cfg)
        if params is None:
            params = init_params(model_cfg, train_cfg.seed)
        self._treedef = jax.tree.structure(params)
        self._shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(params)]
        # where params and optimiser state live: replicated, or split (fsdp)
        self.placement = where = placement(params, self.mesh)
        self._param_shardings = jax.tree.leaves(param_shardings(where, self.mesh))
        self._state_shardings = state_shardings(self.optimizer, where, self.mesh)
        self._train_step = _cached_train_step(model_cfg, train_cfg, self.mesh, where)
        self._eval_step = _cached_eval_step(model_cfg, self.mesh, where)
        self.params = params
        init_state = jax.jit(self.optimizer.init, out_shardings=self._state_shardings)
        self.opt_state: OptState = init_state(self._params)
        self.batches = batches
        self.steps_done = 0  # inner steps taken; the next batch is batches[steps_done]
        self.tokens_total = 0  # tokens trained on (targets predicted) since step 0
        self._compiled: Step = None  # the AOT-compiled train step, made by compile()
        self.compile_time_s = 0.0
        self.eval_set: list[np.ndarray] = []
        if heldout is not None and train_cfg.eval_every:
            self.eval_set = eval_batches(
                heldout,
                context=model_cfg.context,
                batch_size=train_cfg.batch_size,
                num_batches=train_cfg.eval_batches,
            )

    # -- parameters ----------------------------------------------------------------

    @property
    def params(self) -> Params:
        params: Params = self._params
        return params

    @params.setter
    def params(self, tree: Params) -> None:
        """Adopts a whole new tree (same structure and shapes), placed on the mesh.

        Leaves are copied: changing the caller's numpy arrays later does not reach the
        trainer (the sync client may hand in views of its own fragment buffers).
        """
        if jax.tree.structure(tree) != cast(Any, self._treedef):
            raise ValueError("new params have a different tree structure than the model's")
        leaves = jax.tree.leaves(tree)
        for leaf, shape in zip(leaves, self._shapes):
            if tuple(np.shape(leaf)) != shape:
                raise ValueError(f"new params: a leaf has shape {np.shape(leaf)}, want {shape}")
        self._params = jax.tree.unflatten(
            self._treedef, [_place(_f32(x), s) for x, s in zip(leaves, self._param_shardings)]
        )

    def set_tensors(self, tensors: Mapping[str, Any]) -> None:
        """Replaces the named tensors ("/"-joined, e.g. "blocks/0/attn/wq"), keeps the rest.

        Takes `wire.plan.FragmentPlan.unflatten_fragment`'s output directly; copies it.
        """
        tree = jax.tree.map(lambda x: x, self._params)  # a fresh copy of the dict nesting
        for name, value in tensors.items():
            *path, leaf = name.split("/")
            node = tree
            for key in path:
                if not isinstance(node, dict) or key not in node:
                    raise KeyError(f"no tensor {name!r} in the model")
                node = node[key]
            if not isinstance(node, dict) or leaf not in node or isinstance(node[leaf], dict):
                raise KeyError(f"no tensor {name!r} in the model")
            if tuple(np.shape(value)) != tuple(node[leaf].shape):
                raise ValueError(
                    f"tensor {name!r}: shape {np.shape(value)}, want {tuple(node[leaf].shape)}"
                )
            node[leaf] = _place(_f32(value), node[leaf].sharding)
        self._params = tree

    # -- stepping ------------------------------------------------------------------

    def compile(self) -> float:
        """Compiles the train step ahead of time (step() does it if needed); returns seconds.

        Kept out of step()'s timing, so the first step's compile is never multiplied by
        the slowdown factor.
        """
        if self._compiled is None:
            start = time.perf_counter()
            batch = _shape_dtype(
                (self.train_cfg.batch_size, self.model_cfg.context + 1),
                jnp.int32,
                sharding=self._batch_sharding,
            )
            self._compiled = self._train_step.lower(self._params, self.opt_state, batch).compile()
            self.compile_time_s = time.perf_counter() - start
        return self.compile_time_s

    def step(self, evaluate: bool = True) -> Metrics:
        """One inner step on batch `steps_done` (and the evaluation due after it, unless
        `evaluate` is False: a caller that times its evaluations itself).

        Returns:
          {"step": steps done after it, "loss", "grad_norm", "lr", "tokens" (this step),
           "tokens_total", "step_time_s" (measured compute), "wall_time_s" (with the
           slowdown sleep), "tokens_per_s" (tokens / wall_time_s)}, plus "eval_loss" and
          "eval_bits_per_byte" when an evaluation was due (not counted in the times).
        """
        self.compile()
        start = time.perf_counter()
        want = (self.train_cfg.batch_size, self.model_cfg.context + 1)
        if not self._batch_sharding.is_fully_addressable and hasattr(self.batches, "rows"):
            # Several processes: each reads and places only its own rows of the batch.
            mine = local_rows(self._batch_sharding, want)
            part = np.asarray(self.batches.rows(self.steps_done, mine))
            if part.shape != (mine.stop - mine.start, want[1]):
                raise ValueError(
                    f"batch {self.steps_done} rows {mine.start}:{mine.stop} have shape "
                    f"{part.shape}, want {(mine.stop - mine.start, want[1])}"
                )
            batch = _from_local_data(self._batch_sharding, part, want)
        else:
            rows = np.asarray(self.batches[self.steps_done])
            if rows.shape != want:
                raise ValueError(
                    f"batch {self.steps_done} has shape {rows.shape}, want {want} "
                    f"(batch_size, context + 1)"
                )
            batch = global_batch(rows, self._batch_sharding)
        lr = lr_at(self.train_cfg, self.steps_done)
        params, opt_state, out = self._compiled(self._params, self.opt_state, batch)
        loss, grad_norm = float(out["loss"]), float(out["grad_norm"])  # waits for the step
        elapsed = time.perf_counter() - start
        if self.slowdown > 1:
            self.sleep((self.slowdown - 1) * elapsed)
        wall = time.perf_counter() - start
        self._params, self.opt_state = params, opt_state
        tokens = self.train_cfg.batch_size * self.model_cfg.context
        self.steps_done += 1
        self.tokens_total += tokens
        metrics = {
            "step": self.steps_done,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "tokens_total": self.tokens_total,
            "step_time_s": elapsed,
            "wall_time_s": wall,
            "tokens_per_s": tokens / wall,
        }
        if evaluate and self.eval_due():
            result = self.evaluate()
            metrics.update(eval_loss=result["loss"], eval_bits_per_byte=result["bits_per_byte"])
        return metrics

    def eval_due(self) -> bool:
        """Whether the step just done is one after which an evaluation is due."""
        return bool(self.eval_set) and self.steps_done % self.train_cfg.eval_every == 0

    def evaluate(self, batches: Sequence[np.ndarray] | None = None) -> Metrics:
        """Held-out {"loss", "bits_per_byte"} of the current params (default: eval_set)."""
        batches = self.eval_set if batches is None else batches
        return evaluate(
            self._params, batches, self.model_cfg, self.mesh, _eval_step=self._eval_step
        )

    # -- save / resume ---------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Host copies of everything a resume needs, with the configs they were made with."""
        return {
            "model_config": dataclasses.asdict(self.model_cfg),
            "train_config": dataclasses.asdict(self.train_cfg),
            "params": jax.device_get(self._params),
            "opt_state": jax.device_get(self.opt_state),
            "steps_done": self.steps_done,
            "tokens_total": self.tokens_total,
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Resumes from `snapshot()`; ValueError if it is of a different model."""
        if snapshot["model_config"] != dataclasses.asdict(self.model_cfg):
            raise ValueError(
                f"snapshot is of model {snapshot['model_config']}, this trainer "
                f"runs {dataclasses.asdict(self.model_cfg)}"
            )
        self.params = snapshot["params"]
        state = snapshot["opt_state"]
        if cast(Any, jax.tree.structure(state)) != jax.tree.structure(self.opt_state):
            raise ValueError(
                "snapshot's optimiser state does not match this trainer's "
                "optimiser (different TrainConfig, e.g. grad_clip on/off?)"
            )
        self.opt_state = jax.tree.map(_place, state, self._state_shardings)
        self.steps_done = int(snapshot["steps_done"])
        self.tokens_total = int(snapshot["tokens_total"])
