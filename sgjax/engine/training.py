"""Serving a training loop (the Engine's `WeightsControl` part): weights updated in place from a trainer's pytree or
a checkpoint, generation paused and continued, the KV pool's memory given back and taken again. SGLang's names and
semantics: `update_weights_from_disk`, `pause_generation(mode)`, `continue_generation`, `release_memory_occupation`,
`resume_memory_occupation`, `get_weights_version`.

An update waits for the running requests to finish on the old weights while new ones wait (SGLang's default), or
aborts them (`abort_all_requests`), or sends them back to the queue to run again on the new weights (`retract`).
Cached prefixes never cross an update: the radix cache is flushed when nothing runs, and every request's KV is
keyed by the weights' generation (scheduler._namespace), so a request paused in place over an update caches its
pages where no later request looks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import jax
import numpy as np

from sgjax.engine.loading import forget, read_for_plan, run_weights
from sgjax.errors import RequestError
from sgjax.model.weights import Weights, dummy_weights, from_hf_state_dict

PAUSE_MODES = ("abort", "retract", "in_place")


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)


def mismatch(given, reference) -> str | None:
    """The first leaf of `given` whose path, shape or dtype differs from `reference`'s, described (None: none)."""
    got, ref = _leaves(given), _leaves(reference)
    if got[1] != ref[1]:
        paths = {jax.tree_util.keystr(p) for p, _ in ref[0]} ^ {jax.tree_util.keystr(p) for p, _ in got[0]}
        return f"its structure differs from the model's (leaves {sorted(paths)[:4]})" if paths else "its structure"
    for (path, a), (_, b) in zip(got[0], ref[0]):
        if (a is None) != (b is None):
            return f"{jax.tree_util.keystr(path)} is {'None' if a is None else 'given'}, the model's is not"
        if a is None:
            continue
        if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
            return (
                f"{jax.tree_util.keystr(path)} is {np.dtype(a.dtype).name}{list(a.shape)}, the model's is "
                f"{np.dtype(b.dtype).name}{list(b.shape)}"
            )
    return None


@functools.lru_cache(maxsize=4)
def _param_spec(cfg):
    """The model's params as loaded: shapes and dtypes only (traced once per config, nothing allocated)."""
    return jax.eval_shape(lambda: dummy_weights(cfg))


class WeightsControl:
    """The Engine's training-loop methods; the state they read (runner, scheduler, model_config, plan, mesh) is the
    Engine's (engine/engine.py)."""

    # -- weights ----------------------------------------------------------------------------------------
    def update_weights(
        self,
        params,
        version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        retract: bool = False,
    ) -> str:
        """Serve `params` from now on: a pytree in the layout of the model's params (model.weights.Weights, as
        loaded, or as this engine's step reads them, which is served as it is: no copy when the arrays already lie
        where the engine's do), or a dict of HF checkpoint names. Returns the new weights version (`version`, else
        the update count). Running requests finish on the old weights first (new ones wait), unless
        `abort_all_requests` (they end, aborted) or `retract` (they run again on the new weights)."""
        return self._apply(self._served_weights(params), version, flush_cache, abort_all_requests, retract)

    def _apply(self, new: Weights, version, flush_cache: bool, abort_all_requests: bool, retract: bool) -> str:
        if abort_all_requests and retract:
            raise RequestError("abort_all_requests and retract: choose one", "retract")
        was_paused = self._paused
        if not was_paused:
            if not (abort_all_requests or retract):
                self._finish_running()
            self.pause_generation("abort" if abort_all_requests else "retract" if retract else "in_place")
        try:
            return self._call(lambda: self._swap_weights(new, version, flush_cache))
        finally:
            if not was_paused:
                self.continue_generation()

    def update_weights_from_disk(
        self,
        model_path: str,
        version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        retract: bool = False,
    ) -> str:
        """update_weights with a checkpoint the loader reads (an HF directory, a GGUF file, an orbax checkpoint), read
        as at start (a GGUF's blocks kept where the plan runs them) in the engine's dtype."""
        try:
            cfg, new = read_for_plan(model_path, self.model_config.dtype, self.plan, self._tp_mesh)
        except (OSError, ValueError, KeyError) as e:
            raise RequestError(f"model_path: {e}", "model_path") from e
        why = mismatch(new, self.runner.weights)
        if why is not None:
            raise RequestError(f"model_path: a checkpoint unlike the served model's: {why}", "model_path")
        return self._apply(new, version, flush_cache, abort_all_requests, retract)

    @property
    def _tp_mesh(self):
        return self.mesh if self.args.tp_size > 1 else None

    def get_weights_version(self) -> str:
        return self.weights_version

    def _served_weights(self, params) -> Weights:
        """`params` as the step reads them, checked leaf by leaf against the model's."""
        cfg = self.model_config
        if isinstance(params, Mapping):
            try:
                params = from_hf_state_dict(cfg, lambda name: np.asarray(params[name]), set(params))
            except (KeyError, ValueError) as e:
                raise RequestError(f"params: {e} (a dict of HF checkpoint names)", "params") from e
        if not isinstance(params, Weights):
            raise RequestError("params: a Weights pytree (sgjax.model.weights) or a dict of HF names", "params")
        served = self.runner.weights
        if mismatch(params, served) is None:  # the step's own layout: served as it is, placed like the engine's
            return jax.tree.map(lambda a, b: a if a is None else jax.device_put(a, b.sharding), params, served)
        why = mismatch(params, _param_spec(cfg))
        if why is not None:
            raise RequestError(f"params: {why}", "params")
        return run_weights(cfg, params, self.plan, self._tp_mesh)

    def _finish_running(self) -> None:
        """Admit no request until the running ones have finished (on the engine's current weights)."""
        self._call(lambda: setattr(self.scheduler, "admitting", False))
        try:
            while self._call(lambda: len(self.scheduler.running)):
                time.sleep(0.005)
        except BaseException:
            self._call(lambda: setattr(self.scheduler, "admitting", True))
            raise

    def _swap_weights(self, weights: Weights, version: str | None, flush_cache: bool) -> str:
        """On the engine thread, paused (no step in flight)."""
        sched = self.scheduler
        forget(self.runner.weights)  # the process's cache of them: no second copy stays
        self.runner.weights = weights
        sched.generation += 1
        sched.admitting = True
        self.weights_version = version if version is not None else str(sched.generation)
        if flush_cache and not sched.running:  # requests paused in place keep their pages (other generation)
            sched.cache.reset()
        return self.weights_version

    # -- generation -------------------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop running steps. `mode`: "abort" ends every waiting and running request, "retract" sends the running
        ones back to the queue (they run again, from their prompt and output so far, after continue_generation),
        "in_place" keeps them as they are. New requests queue meanwhile."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
        self._call(lambda: setattr(self, "_paused", True))
        # a second call runs at the paused loop's top, once the step in flight (overlap) is committed
        if mode == "abort":
            self._call(self.outputs.abort_all)
        elif mode == "retract":
            self._call(lambda: [self.scheduler.retract(r) for r in list(self.scheduler.running)])
        else:
            self._call(lambda: None)

    def continue_generation(self) -> None:
        self._call(lambda: setattr(self, "_paused", False))

    @property
    def paused(self) -> bool:
        return self._paused

    # -- memory -----------------------------------------------------------------------------------------
    def release_memory_occupation(self) -> None:
        """Give the KV pool's device memory back (generation pauses; every request is aborted and the radix cache
        emptied, since their pages go with it)."""
        self.pause_generation("abort")
        self._call(self._drop_pool)

    def resume_memory_occupation(self) -> None:
        """Make the KV pool again and continue generating."""
        self._call(self.runner.reset_pool)
        self.continue_generation()

    def _drop_pool(self) -> None:
        self.scheduler.cache.reset()
        self.runner.state = None
