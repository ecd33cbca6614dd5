"""The worker side: what runs on every tensor-parallel rank of a vLLM server,
called in order with the serving steps through ``collective_rpc``.

`ResidentWorker` is vLLM's ``worker_extension_cls``: its methods are added to
every worker, and ``collective_rpc("rt_step", args=...)`` runs one on every
rank and returns one result per rank, in rank order. A call blocks serving
while it runs, so a job is one call per microbatch with serving in between
(the driver, resident_trainer.integrations.vllm.driver, makes the calls).

Each method returns a plain dict and never raises: an exception becomes
``{"error": "..."}`` in that rank's result, the driver sees it in the same
call's results, and every rank aborts at that boundary. A failure inside a
training collective (a peer gone) surfaces as a gloo/NCCL error on the
trainer group, whose timeout is the protocol's exchange timeout.

The training core is the engine-agnostic one: a `Trainer` over a
`VllmAdapter` (the rank's sharded modules, recomputed functionally), an
`AddedSharedNeurons` block split over the ranks, and the vocabulary-parallel
streamed loss over the rank's shard of the head. Serving reads the
`ServedBlock` the plugin installed; a publish gathers the trained shards into
it.
"""

from __future__ import annotations

import datetime
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Reported next to every digest: a digest is only comparable with one of the
# same definition version.
from resident_trainer.ops.fingerprint_version import FINGERPRINT_VERSION

FINGERPRINT_IMPL = "auto"


def _guarded(fn: Callable[..., dict]) -> Callable[..., dict]:
    """Turn any exception into this rank's error result (the server lives on)."""

    def call(self, *args, **kwargs) -> dict:
        t0 = time.perf_counter()
        try:
            out = fn(self, *args, **kwargs)
        except Exception as exc:  # the trainer's or the model's failure: the job aborts, never the server
            out = {"error": f"rank {_rank(self)}: {type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-4000:]}
        out.setdefault("error", None)
        out["rank"] = _rank(self)
        out["seconds"] = round(time.perf_counter() - t0, 6)
        return out

    call.__name__, call.__doc__ = fn.__name__, fn.__doc__
    return call


def _rank(worker) -> int:
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().rank_in_group


@dataclass
class _State:
    settings: dict
    adapter: Any
    block: Any
    served: Any
    group: Any  # the trainer's own process group (gloo on CPUs)
    cpu_group: Any  # gloo group for small host-side reductions (fingerprints, the step's go/no-go)
    tokenizer: Any
    monitor: Any
    rank: int
    world: int
    base: Any = None  # the frozen base's checkpoint fingerprint table, at setup
    trainer: Any = None
    job: dict | None = None
    published: dict = field(default_factory=dict)
    budget_interval: float = 0.05


class ResidentWorker:
    """Methods added to every vLLM worker (``worker_extension_cls``)."""

    # --- set-up -----------------------------------------------------------------

    @_guarded
    def rt_setup(self, options: dict) -> dict:
        """Build this rank's trainer pieces once: a trainer process group,
        the adapter over the served modules, the training block (its shard
        of the neurons) and the base fingerprint. options: exchange_timeout,
        memory_floor, workspace_ceiling."""
        from vllm.distributed.parallel_state import get_tp_group

        from resident_trainer.integrations.torchdist.memory import system_sampler
        from resident_trainer.integrations.vllm.plugin import settings_of
        from resident_trainer.models.vllm import VllmAdapter
        from resident_trainer.protocol.budget import BudgetMonitor, MemoryBudget
        from resident_trainer.train import AddedSharedNeurons

        model = self.model_runner.model
        settings = settings_of(self.vllm_config)
        served = getattr(model, "rt_served", None)
        if settings is None or served is None:
            raise RuntimeError("the resident_trainer plugin is not active in this engine (no additional_config entry)")
        tp = get_tp_group()
        world, rank = tp.world_size, tp.rank_in_group
        if dist.is_initialized() and dist.get_world_size() != world:
            raise RuntimeError(f"only tensor parallelism is supported: {dist.get_world_size()} processes, TP {world}")
        timeout = datetime.timedelta(seconds=float(options.get("exchange_timeout", 60.0)))
        # The trainer's own groups, never vLLM's: training traffic does not
        # mix with serving collectives. One on the model's device (NCCL on
        # GPUs) for the step, one gloo group for small host-side reductions.
        group = cpu_group = None
        if world > 1:
            cpu_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
            group = (
                dist.new_group(list(range(world)), backend="nccl", timeout=timeout)
                if model.lm_head.weight.is_cuda
                else cpu_group
            )
        adapter = VllmAdapter(model, group, rank=rank, world=world)
        layer = model.rt_served_layer
        block = AddedSharedNeurons(
            adapter.hidden_size,
            served.num_neurons,
            dtype=adapter.dtype,
            device=adapter.device,
            process_group=group,
            seed=int(settings.get("seed", 0)),
        )
        block.attach(adapter, layer)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.vllm_config.model_config.tokenizer, local_files_only=True)

        def workspace() -> int:
            st = getattr(self, "_rt", None)
            tr = st.trainer if st is not None else None
            if tr is None:
                return 0
            n = sum(p.numel() * p.element_size() for p in tr.params)
            return 4 * n  # weights, gradients, two AdamW moments

        device = "cuda" if adapter.device.type == "cuda" else "cpu"
        monitor = BudgetMonitor(
            MemoryBudget(int(options.get("memory_floor", 1 << 30)), int(options.get("workspace_ceiling", 2 << 30))),
            system_sampler(workspace, device),
        )
        self._rt = _State(settings, adapter, block, served, group, cpu_group, tokenizer, monitor, rank, world)
        self._rt.budget_interval = float(options.get("budget_interval", 0.05))
        self._rt.base = self._rt_checkpoint_table()
        return {
            "layer": layer,
            "num_neurons": served.num_neurons,
            "neurons": [block.neuron_start, block.neuron_stop],
            "vocab": list(adapter.vocab_shard),
            "world": world,
            "fingerprint": self._rt.base.hex,
            "fingerprint_version": FINGERPRINT_VERSION,
        }

    def _rt_checkpoint_table(self):
        from resident_trainer.models.vllm import checkpoint_pieces
        from resident_trainer.ops.fingerprint import fingerprint_sharded_tensors

        st = self._rt
        return fingerprint_sharded_tensors(
            checkpoint_pieces(st.adapter).tensors, process_group=st.cpu_group, impl=FINGERPRINT_IMPL
        )

    # --- a job --------------------------------------------------------------------

    @_guarded
    def rt_begin(self, job: dict) -> dict:
        """Start job `job` on this rank: facts, anchors (prompt, reply ids),
        training settings; the block starts from what is served now."""
        from resident_trainer.train import StreamedCrossEntropy, TrainConfig, Trainer, parse_fact
        from resident_trainer.train.config import fact_neurons

        st = self._st()
        if st.trainer is not None:
            raise RuntimeError(f"job {st.job['id']} is still open on this rank")
        settings = dict(job.get("settings") or {})
        settings["layer"] = self.model_runner.model.rt_served_layer
        settings["num_neurons"] = st.served.num_neurons
        config = TrainConfig(**settings)
        facts = [parse_fact(f, f"facts[{i}]") for i, f in enumerate(job["facts"])]
        anchors = [(a[0], [int(t) for t in a[1]]) for a in job.get("anchors", ())]
        negatives = [(a[0], [int(t) for t in a[1]]) for a in job.get("negatives", ())]
        start, _ = st.adapter.vocab_shard
        loss_fn = StreamedCrossEntropy(
            st.adapter,
            head_weight=st.adapter.head_weight,
            head_bias=st.adapter.head_bias,
            process_group=st.group,
            vocab_start=start,
        )
        # The budget is sampled while a job runs (a thread sampling all the
        # time would take the interpreter from serving).
        st.monitor.reset()
        st.monitor.start(st.budget_interval)
        st.trainer = Trainer(
            st.adapter, st.block, st.tokenizer, facts, config, anchors=anchors, loss_fn=loss_fn,
            retract=job.get("retract", ()), negatives=negatives,
        )  # fmt: skip
        st.job = dict(job)
        before = self._rt_checkpoint_table()
        st.job["fingerprint_before"] = before
        # The neurons each new fact got: fewer than wanted when the block has
        # fewer free (the job still teaches them; the status says so).
        given = {r[1] - r[0] for r in st.trainer.ranges if r is not None}
        return {
            "fingerprint": before.hex,
            "fingerprint_version": FINGERPRINT_VERSION,
            "examples": len(st.trainer.examples),
            "fact_neurons": min(given) if given else None,
            "fact_neurons_wanted": fact_neurons(config) if given else None,
        }

    @_guarded
    def rt_step(self, index: int) -> dict:
        """Microbatch `index` of the open job (collectives on the trainer
        group). The ranks first agree whether any of them has a budget
        breach latched: if one has, none steps (a rank stepping alone would
        wait in a collective its peers never join) and each reports it."""
        st = self._st(job=True)
        breach = st.monitor.breach()
        if st.group is not None:
            flag = torch.tensor([1 if breach else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=st.cpu_group)
            stop = bool(flag.item())
        else:
            stop = breach is not None
        if stop:
            return {"budget": f"rank {st.rank}: {breach}" if breach else None, "skipped": True}
        metrics = st.trainer.step(index)
        breach = st.monitor.breach()
        return {**metrics, "budget": f"rank {st.rank}: {breach}" if breach else None}

    @_guarded
    def rt_verify(self) -> dict:
        """The frozen base after the job: this rank's own tensors unchanged,
        and the whole checkpoint's fingerprint (the same on every rank)."""
        from resident_trainer.train import FrozenWeightsChanged

        st = self._st(job=True)
        try:
            st.trainer.frozen.check(st.trainer.base_tables)
            local = []
        except FrozenWeightsChanged as exc:
            local = [str(exc)]  # reported, not raised: the driver compares every rank's digest
        after = self._rt_checkpoint_table()
        changed = after.changed(st.job["fingerprint_before"])
        return {
            "fingerprint": after.hex,
            "fingerprint_version": FINGERPRINT_VERSION,
            "changed": changed[:8],
            "local": local,
        }

    @_guarded
    def rt_checkpoint(self, root: str, group: str, serial: int) -> dict:
        """Write this rank's shard of the trained block (gate calibrated) to
        the checkpoint store; returns its SHA-256."""
        from resident_trainer.protocol.checkpoint import CheckpointStore
        from resident_trainer.protocol.fs import LocalFileSystem

        st = self._st(job=True)
        data = st.trainer.checkpoint()
        digest = CheckpointStore(LocalFileSystem(), root).write_shard(group, serial, st.rank, data)
        return {"shard": digest}

    @_guarded
    def rt_publish(self, version: str) -> dict:
        """Serve the trained block from the next serving step on: this rank's
        trained shard becomes its published shard, and the shards of every
        rank are gathered into the served block."""
        st = self._st(job=True)
        st.trainer.publish()
        self._rt_serve_published(version)
        self._rt_end_job()
        from resident_trainer.train.block import threshold_summary

        return {"version": version, "threshold": threshold_summary(st.block.published_threshold)}

    @_guarded
    def rt_discard(self) -> dict:
        """Drop the open job's unpublished training (serving is untouched)."""
        st = self._st()
        if st.trainer is not None:
            st.trainer.discard()
        self._rt_end_job()
        return {}

    def _rt_end_job(self) -> None:
        st = self._rt
        st.monitor.stop()
        st.trainer, st.job = None, None

    # --- what is served ---------------------------------------------------------------

    def _rt_serve_published(self, version: str) -> None:
        st = self._rt
        b = st.block
        a = b.local_neurons
        gate, up, down = b.published_gate_up[:a], b.published_gate_up[a:], b.published_down
        thr = b.published_threshold
        if isinstance(thr, torch.Tensor):
            thr = thr.to(device=down.device, dtype=torch.float32)
        elif thr is not None:  # one threshold for every neuron (an earlier checkpoint)
            thr = torch.full((a,), float(thr), dtype=torch.float32, device=down.device)
        arming = b.published_arming
        if st.world > 1:
            gate, up, down = (self._rt_gather(t, dim) for t, dim in ((gate, 0), (up, 0), (down, 1)))
            # Every rank has a gate or none (they calibrate at the same publish), and arming or none.
            thr = None if thr is None else self._rt_gather(thr, 0)
            arming = None if arming is None else (self._rt_gather(arming[0], 0), self._rt_gather(arming[1], 0))
        st.served.load(torch.cat([gate, up]), down, thr, version, arming=arming)

    def _rt_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        st = self._rt
        parts = [torch.empty_like(t) for _ in range(st.world)]
        dist.all_gather(parts, t.contiguous(), group=st.group)
        return torch.cat(parts, dim=dim)

    @_guarded
    def rt_restore(self, root: str) -> dict:
        """Serve the last good checkpoint (after a restart): this rank's
        shard becomes the block's published and trainable weights."""
        from resident_trainer.protocol.checkpoint import CheckpointStore
        from resident_trainer.protocol.fs import LocalFileSystem
        from resident_trainer.train.checkpoint import load_block

        st = self._st()
        store = CheckpointStore(LocalFileSystem(), root)
        loaded = store.load(st.rank)
        if loaded is None:
            return {"version": st.served.version, "restored": False}
        manifest, data = loaded
        load_block(st.block, data, publish=True)
        version = str(manifest.meta.get("version", manifest.name))
        self._rt_serve_published(version)
        return {"version": version, "restored": True, "job": manifest.name}

    @_guarded
    def rt_status(self) -> dict:
        """What this rank serves and trains now."""
        st = self._st()
        return {
            "version": st.served.version,
            "served_sum": float(st.served.down.double().abs().sum()),
            "job": None if st.job is None else st.job.get("id"),
            "budget": st.monitor.breach(),
            "taught": [e["question"] for e in st.block.published_memory["taught"]],
        }

    def _st(self, job: bool = False) -> _State:
        st = getattr(self, "_rt", None)
        if st is None:
            raise RuntimeError("rt_setup has not run on this rank")
        if job and st.trainer is None:
            raise RuntimeError("no job is open on this rank")
        return st
