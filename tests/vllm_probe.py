"""A test worker extension: the production ResidentWorker plus probes that
read a rank's state and a way to inject faults on one rank. The vLLM workers
import it by name (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import torch

from resident_trainer.integrations.vllm.worker import ResidentWorker, _guarded
from resident_trainer.protocol.budget import MemoryBudget


class ProbeWorker(ResidentWorker):
    @_guarded
    def rt_probe_grads(self) -> dict:
        b = self._st().block
        return {"gate_up": b.w_gate_up.grad.tolist(), "down": b.w_down.grad.tolist(),
                "neurons": [b.neuron_start, b.neuron_stop]}  # fmt: skip

    @_guarded
    def rt_probe_published(self) -> dict:
        """This rank's published shard and the whole served block."""
        st = self._st()
        b = st.block
        return {
            "neurons": [b.neuron_start, b.neuron_stop],
            "gate_up": b.published_gate_up.tolist(),
            "down": b.published_down.tolist(),
            "threshold": b.published_threshold.tolist() if b.published_threshold is not None else None,
            "served_gate_up": st.served.gate_up.tolist(),
            "served_down": st.served.down.tolist(),
            "served_threshold": st.served.threshold.tolist(),
            "served_arming": [st.served.arming.tolist(), st.served.arming_threshold.tolist()]
            if st.served.arming_on
            else None,
        }

    @_guarded
    def rt_probe_storage(self) -> dict:
        """Whether every tensor the replay reads is the served model's own
        storage (a parameter, or a plain weight vLLM loaded)."""
        st = self._st()
        model = self.model_runner.model
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        own |= {  # the plain tensors the plugin kept (rt_weight, rt_w13_weight, ...)
            v.untyped_storage().data_ptr()
            for m in model.modules()
            for k, v in vars(m).items()
            if k.startswith("rt_") and isinstance(v, torch.Tensor)
        }
        frozen = st.adapter.frozen_tensors()
        return {
            "tensors": len(frozen),
            "shared": sum(t.untyped_storage().data_ptr() in own for t in frozen.values()),
            "head_is_embedding": st.adapter.head_weight.data_ptr() == st.adapter.embed.weight.data_ptr(),
        }

    @_guarded
    def rt_probe_ceiling(self, rank: int, ceiling: int) -> dict:
        """Give rank `rank` a workspace ceiling of `ceiling` bytes: its real
        budget monitor then latches a breach while a job holds more."""
        st = self._st()
        if st.rank == rank:
            st.monitor.budget = MemoryBudget(st.monitor.budget.floor, ceiling)
        return {}

    @_guarded
    def rt_probe_corrupt(self, rank: int) -> dict:
        """Change one frozen weight on rank `rank` (a fault the fingerprint must catch)."""
        st = self._st()
        if st.rank == rank:
            w = st.adapter.final_norm.weight
            with torch.no_grad():
                w.view(torch.int32)[0] ^= 1
        return {}
