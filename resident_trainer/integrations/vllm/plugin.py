"""The vLLM plugin (entry point ``vllm.general_plugins``, run in every vLLM
process): it makes a served model trainable in place, and does nothing unless
the engine's ``additional_config`` has a ``"resident_trainer"`` entry
(`resident-trainer serve` sets it).

Two things have to happen while vLLM loads the model, before its first forward
(which is when vLLM compiles it), so they hook the model runner's
``load_model``:

- keep the plain linear weights. On the CPU vLLM repacks every linear layer's
  weight for oneDNN and drops the plain one (``dispatch_cpu_unquantized_gemm``,
  called with ``remove_weight=True``). The replay needs ``W`` itself for
  ``dx = dy W``, so the loader's packing step is wrapped to keep a reference
  as ``layer.rt_weight`` (the loaded tensor itself, not a copy: the packed
  copy is vLLM's). GPUs keep ``layer.weight`` and nothing is kept twice.
  The MoE experts are the same story: on the CPU vLLM pads the expert
  weights' intermediate dimension and prepacks them, so the loaded
  ``w13_weight`` and ``w2_weight`` are kept as ``rt_w13_weight`` and
  ``rt_w2_weight``.
- install the served block (`ServedBlock`) on layer L's feed-forward module:
  buffers and a forward hook, so compiled graphs (and CUDA graphs) read the
  buffers that a job later updates in place.

Both wrappers are installed once per process and look up the setting on each
call, so a vLLM engine without the setting in the same process is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import threading

CONFIG_KEY = "resident_trainer"

_installed = False
_lock = threading.Lock()
_loading = threading.local()


def settings_of(vllm_config) -> dict | None:
    """The plugin's settings in a VllmConfig (None: the plugin is off)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    value = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    return dict(value) if isinstance(value, dict) else None


def register() -> None:
    """vllm.general_plugins entry point: wrap the loader steps (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _wrap_linear_packing()
        _wrap_moe_packing()
        _wrap_load_model()
        _installed = True


def _wrap_linear_packing() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    original = UnquantizedLinearMethod.process_weights_after_loading

    @functools.wraps(original)
    def process_weights_after_loading(self, layer):
        plain = getattr(layer, "weight", None)
        original(self, layer)
        if getattr(_loading, "keep", False) and plain is not None:
            now = getattr(layer, "weight", None)
            if now is None or now.data_ptr() != plain.data_ptr() or now.numel() != plain.numel():
                layer.rt_weight = plain.data

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading


def _wrap_moe_packing() -> None:
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without this MoE method: nothing to keep
        return
    original = UnquantizedFusedMoEMethod.process_weights_after_loading

    @functools.wraps(original)
    def process_weights_after_loading(self, layer):
        names = ("w13_weight", "w2_weight")
        plain = {n: getattr(layer, n, None) for n in names}
        plain = {n: (t.data if t is not None else None) for n, t in plain.items()}
        original(self, layer)
        if not getattr(_loading, "keep", False):
            return
        for n, t in plain.items():
            now = getattr(layer, n, None)
            if t is not None and (now is None or now.data_ptr() != t.data_ptr() or now.shape != t.shape):
                setattr(layer, f"rt_{n}", t)

    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading


def _wrap_load_model() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runners.append(CPUModelRunner)
    except ImportError:  # a GPU build of vLLM
        pass
    for cls in runners:
        if "load_model" not in cls.__dict__:
            continue
        original = cls.__dict__["load_model"]

        @functools.wraps(original)
        def load_model(self, *args, __original=original, **kwargs):
            settings = settings_of(self.vllm_config)
            if settings is None:
                return __original(self, *args, **kwargs)
            with _keeping_plain_weights():
                out = __original(self, *args, **kwargs)
            from resident_trainer.integrations.vllm.served import install_served_block

            install_served_block(self.model, settings, block_size=self.vllm_config.cache_config.block_size)
            return out

        cls.load_model = load_model


@contextlib.contextmanager
def _keeping_plain_weights():
    prev = getattr(_loading, "keep", False)
    _loading.keep = True
    try:
        yield
    finally:
        _loading.keep = prev
