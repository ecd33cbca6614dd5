"""The invariants of docs/ARCHITECTURE.md, checked after a run, and what a
run exercised (its coverage). Mixed into `Simulation`: the checks read the
run's records (receipts, phase logs, collectives, files) and nothing else."""

from __future__ import annotations

import collections
import hashlib
import math
from typing import TYPE_CHECKING

from resident_trainer.protocol.checkpoint import CheckpointStore, CorruptCheckpoint
from resident_trainer.protocol.hotload import code_digest
from resident_trainer.protocol.records import read_jsonl
from resident_trainer.protocol.server import HeadServer, WorkerServer
from resident_trainer.testing.fakes import hot_source
from resident_trainer.testing.scenario import AUTHORITY, COVERED_PHASES, FAULTS, HOT_MODULE, STEP_MAX, TIMEOUTS

if TYPE_CHECKING:
    from resident_trainer.testing.simulation import SimGen


def boundary_kind_of(receipt: dict) -> str:
    """The kind of boundary a receipt's job ended at (see job.boundary_kind)."""
    b, last = receipt.get("boundary"), receipt.get("last")
    if b is None or last is None:
        return "-"
    if b == -1:
        return "seal"
    if receipt.get("kind") == "hotload":
        return "load" if b == 0 else "loaded"
    return "step" if b < last - 1 else ("verify" if b == last - 1 else "commit")


class InvariantChecks:
    """`check()` and `coverage()` of a finished Simulation."""

    def _overlap(self, t0: float, t1: float) -> float:
        """Injected delay (stalls, slow store operations, outages) inside [t0, t1]."""
        total = 0.0
        for spans in self.delays.values():
            for a, b in spans:
                total += max(0.0, min(b, t1) - max(a, t0))
        o = self.sc.outage
        if o:
            total += max(0.0, min(o[1], t1) - max(o[0], t0))
        return total

    def _records(self, gen: SimGen) -> tuple[dict[int, list], dict[int, list]]:
        """Each rank's receipts and phase lines for `gen`, parsed once per
        file state (the checker and the coverage both read them)."""
        # Every write to a MemoryFileSystem file stores a new bytes object.
        key = [self.fs.files.get(path) for r in gen.ranks for path in (r.ctx.log.receipts_path, r.ctx.log.phases_path)]
        cached = self._parsed.get(gen.number)
        if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        receipts = {
            r.rank: [x for x in read_jsonl(self.fs, r.ctx.log.receipts_path) if x["group"] == gen.group]
            for r in gen.ranks
        }
        phases = {
            r.rank: [x for x in read_jsonl(self.fs, r.ctx.log.phases_path) if x["group"] == gen.group]
            for r in gen.ranks
        }
        self._parsed[gen.number] = (key, (receipts, phases))
        return receipts, phases

    def check(self) -> list[str]:
        """Every violated invariant, as a sentence (empty: the run is correct)."""
        v: list[str] = list(self.crashes) + list(self.mismatches)
        v += [f"last good checkpoint unreadable at a restart: {e}" for e in self.load_errors]
        published: set[tuple[str, str]] = set()
        for gen in self.gens:
            if gen.refused:
                if any(gen.coll[r.rank] for r in gen.ranks):
                    v.append(f"generation {gen.number} was refused (stale token) yet ran collectives")
                continue
            receipts, phases = self._records(gen)
            v += self._check_lockstep(gen)
            by_job: dict[str, dict[int, dict]] = {}
            for rank, rs in receipts.items():
                for x in rs:
                    by_job.setdefault(x["job"], {})[rank] = x
            for name, per in by_job.items():
                v += self._check_job(gen, name, per, phases)
            # Decided PUBLISH: the only jobs LAST_GOOD may name (the head can
            # die between its manifest and its receipt).
            published |= {
                (gen.group, p["job"])
                for ps in phases.values()
                for p in ps
                if p["phase"] == "decided" and p.get("v") == "publish"
            }
            v += self._check_authority(gen, by_job, phases)
            v += self._check_serving(gen)
            v += self._check_publish(gen)
            v += self._check_hangs(gen, phases)
        v += self._check_checkpoint(published)
        v += self._check_recovery()
        return v

    def _check_lockstep(self, gen: SimGen) -> list[str]:
        """No rank trains (or serves) alone: collective k is the same op on
        every rank that reached it, and a rank that never reached it is gone."""
        seqs = gen.coll
        longest = max(seqs.values(), key=len)
        for k, (tag, t) in enumerate(longest):
            for r in gen.ranks:
                s = seqs[r.rank]
                if k < len(s):
                    if s[k][0] != tag:
                        return [
                            f"generation {gen.number}: collective {k} is {s[k][0]} on rank {r.rank} but {tag} on another"
                        ]
                elif r.gone_at is None and gen.killed_at is None:
                    what = "trained" if tag[0] == "T" else "served"
                    return [
                        f"generation {gen.number}: a rank {what} alone ({tag} at t={t:.3f}); rank {r.rank} is alive and never joined"
                    ]
        return []

    def _check_job(self, gen: SimGen, name: str, per: dict[int, dict], phases: dict[int, list]) -> list[str]:
        """All ranks end a job alike, at the same boundary; aborts follow any
        rank's reason; nothing publishes over a changed base; STOP stops it."""
        v: list[str] = []
        head = per.get(0)
        if head is None or head["outcome"] == "refused":
            return v
        for rank, x in per.items():
            if rank == 0 or x["outcome"] == "group_lost" or head["outcome"] == "group_lost":
                continue
            if x["outcome"] == "abandoned":
                if x["boundary"] != head["boundary"] or head["outcome"] == "publish":
                    v.append(
                        f"job {name}: rank {rank} abandoned at boundary {x['boundary']}, the head ended {head['outcome']} at {head['boundary']}"
                    )
            elif (x["outcome"], x["boundary"]) != (head["outcome"], head["boundary"]):
                v.append(
                    f"job {name}: rank {rank} ended {x['outcome']} at boundary {x['boundary']}, the head {head['outcome']} at {head['boundary']}"
                )
        for r in gen.ranks[1:]:
            if (
                r.rank not in per
                and r.gone_at is None
                and gen.killed_at is None
                and (head["outcome"], head["boundary"]) != ("cancel", -1)
            ):
                v.append(
                    f"job {name}: rank {r.rank} is alive but has no receipt (the head: {head['outcome']} at {head['boundary']})"
                )
        # Any rank's abort reason at boundary b ends the job at b at the latest.
        if head["outcome"] != "group_lost":
            for rank, ps in phases.items():
                for p in ps:
                    if p["job"] == name and p["phase"] == "reported" and p.get("abort") and p["b"] < head["boundary"]:
                        v.append(
                            f"job {name}: rank {rank} reported an abort at boundary {p['b']}, the job went on to {head['boundary']}"
                        )
                        break
        corrupted = any(c[0] == gen.number and c[2] == name for c in self.corrupted)
        for rank, x in per.items():
            before, after = x.get("fingerprint_before"), x.get("fingerprint_after")
            if before is not None and after is not None and before != after and not corrupted:
                v.append(f"job {name}: rank {rank}'s frozen fingerprint changed without an injected corruption")
            if before is not None and after is None and x["outcome"] not in ("group_lost",):
                v.append(f"job {name}: rank {rank} has no fingerprint after the job")
        if head["outcome"] == "publish":
            for rank, x in per.items():
                if x.get("fingerprint_before") != x.get("fingerprint_after"):
                    v.append(f"job {name}: published although rank {rank}'s frozen fingerprint changed")
            if any(c[0] == gen.number and c[2] == name for c in self.corrupted):
                v.append(f"job {name}: published although the frozen weights changed during it")
        stop = self.sc.stop
        if stop and self.job_index(name) == stop[0]:
            after = [t for (tag, t) in gen.coll[0] if tag[0] == "T" and tag[1] == name and t > stop[1]]
            if len(after) > 1:
                v.append(f"job {name}: {len(after)} steps started after the STOP file appeared (t={stop[1]})")
        if head.get("kind") == "hotload":
            loaded = sorted(rank for rank, x in per.items() if x.get("loaded"))
            digests = {p["digest"] for ps in phases.values() for p in ps if p["phase"] == "load" and p["job"] == name}
            if self.sc.hot_differ is not None and loaded:
                v.append(
                    f"hot-load {name}: ranks {loaded} loaded although rank {self.sc.hot_differ}'s staged bytes differ"
                )
            if len(digests) > 1:
                v.append(f"hot-load {name}: ranks executed different digests {sorted(digests)}")
            src = hot_source(name)
            genuine = {code_digest([(HOT_MODULE, b)])[:16] for b in (src, src + b"# changed after staging\n")}
            if digests - genuine:
                v.append(f"hot-load {name}: the agreed digest {sorted(digests)} is not of any staged version")
            for r in gen.ranks:
                ran = gen.modules[r.rank][HOT_MODULE]["LOADED"].count(name)
                if r.rank not in per:
                    # Gone before its receipt: it may have loaded the agreed bytes once.
                    if ran > 1 or (ran and not digests):
                        v.append(f"hot-load {name}: rank {r.rank} executed it {ran} times without an agreement")
                elif ran != (1 if r.rank in loaded else 0):
                    v.append(
                        f"hot-load {name}: rank {r.rank} executed it {ran} times, its receipt says {'loaded' if r.rank in loaded else 'not loaded'}"
                    )
        return v

    def _check_authority(self, gen: SimGen, by_job: dict, phases: dict[int, list]) -> list[str]:
        v: list[str] = []
        for j in self.sc.jobs:
            if j["authority"] == AUTHORITY or self.job_gen.get(j["name"]) != gen.number:
                continue
            if any(p["phase"] == "start" and p["job"] == j["name"] for ps in phases.values() for p in ps):
                v.append(f"job {j['name']}: started without the authority")
            h = by_job.get(j["name"], {}).get(0)
            if h is not None and h["outcome"] != "refused":
                v.append(f"job {j['name']}: ran without the authority")
        return v

    def _check_serving(self, gen: SimGen) -> list[str]:
        """A chat waits at most one microbatch: at most one step starts
        between its arrival and its first serving iteration, and that
        iteration completes (on every live rank) within one step plus the
        boundary exchanges, plus any delay the scenario injected."""
        v: list[str] = []
        head_steps = [t for (tag, t) in gen.coll[0] if tag[0] == "T"]
        for cid, g in self.chat_gen.items():
            if g != gen.number:
                continue
            chat = self.chat_objs[cid]
            end_of_gen = min(x for x in (gen.ranks[0].gone_at, gen.killed_at, math.inf) if x is not None)
            if chat.first_served is None:
                if end_of_gen == math.inf:
                    v.append(f"chat {cid} (arrived t={chat.arrived:.3f}) was never served")
                continue
            done = chat.first_served
            missed = [r for r in gen.ranks[1:] if gen.serve_times.get(chat.first_msg, {}).get(r.rank) is None]
            if missed and gen.ranks[0].gone_at is not None:
                continue  # the head died before every rank ran the op: the chat died with the server
            for r in gen.ranks[1:]:
                t = gen.serve_times.get(chat.first_msg, {}).get(r.rank)
                if t is not None:
                    done = max(done, t)
                elif r.gone_at is None and gen.killed_at is None:
                    done = math.inf
                else:
                    done = max(done, min(x for x in (r.gone_at, gen.killed_at) if x is not None))
            started = sum(1 for t in head_steps if chat.arrived < t < chat.first_served)
            if started > 1:
                v.append(f"chat {cid} waited through {started} microbatches (arrived t={chat.arrived:.3f})")
            bound = (
                STEP_MAX
                + 2 * TIMEOUTS.exchange
                + TIMEOUTS.pause
                + 0.2
                + self._overlap(chat.arrived, min(done, chat.arrived + 1e3))
            )
            if done - chat.arrived > bound:
                v.append(
                    f"chat {cid} waited {done - chat.arrived:.3f}s (bound {bound:.3f}s, arrived t={chat.arrived:.3f})"
                )
        return v

    def _check_publish(self, gen: SimGen) -> list[str]:
        """Serving sees a job's block only when it publishes: the same jobs
        at the same serving messages on every rank."""
        v: list[str] = []
        head = gen.ranks[0].server.published
        for r in gen.ranks[1:]:
            mine = r.server.published
            n = min(len(head), len(mine))
            short = len(mine) < len(head) and r.gone_at is None and gen.killed_at is None
            if head[:n] != mine[:n] or len(mine) > len(head) or short:
                v.append(f"generation {gen.number}: rank {r.rank} published {mine}, the head {head}")
        return v

    def _check_hangs(self, gen: SimGen, phases: dict[int, list]) -> list[str]:
        """Nothing waits past its timeout; workers leave a group whose head
        died; at the end every live rank is idle and no job key is left."""
        v: list[str] = []
        for rank, ps in phases.items():
            for p in ps:
                if p["phase"] == "timeout":
                    slack = 0.05 + self._overlap(p["deadline"], p["deadline"] + p["late"] + 1e-9)
                    if p["late"] > slack:
                        v.append(f"rank {rank}: a wait ran {p['late']:.3f}s past its deadline (slack {slack:.3f}s)")
        if gen.head_dead_at is not None and gen.killed_at is None:
            for r in gen.ranks[1:]:
                limit = (
                    TIMEOUTS.group + TIMEOUTS.decision + 0.5 + self._overlap(gen.head_dead_at, gen.head_dead_at + 60)
                )
                if r.gone_at is None:
                    v.append(f"generation {gen.number}: rank {r.rank} still running after its head died")
                elif r.gone_at - gen.head_dead_at > limit:
                    v.append(
                        f"generation {gen.number}: rank {r.rank} left {r.gone_at - gen.head_dead_at:.3f}s after its head died"
                    )
        if gen is self.gen and gen.killed_at is None:
            for r in gen.ranks:
                if r.gone_at is not None or r.refused:
                    continue
                s = r.server
                if isinstance(s, HeadServer) and (
                    s.job is not None or s.queue or s.closing or s.outbox or s.live or s.waiting
                ):
                    state = s.job.state if s.job is not None else "-"
                    v.append(
                        f"the head is still busy at the end (job state {state}, {len(s.closing)} closing, {len(s.live)} live chats)"
                    )
                if isinstance(s, WorkerServer) and s.job is not None:
                    v.append(f"rank {r.rank} is still in job {s.job.spec.name} (state {s.job.state}) at the end")
            if gen.ranks[0].gone_at is None:
                left = [k for k in gen.store.keys() if k.startswith("rt/") and not k.endswith("/closed")]
                if left:
                    v.append(f"generation {gen.number}: keys of finished jobs remain: {left[:4]}")
        return v

    def _check_checkpoint(self, published: set[tuple[str, str]]) -> list[str]:
        """The last good checkpoint is intact and names a published job."""
        store = CheckpointStore(self.fs, "/ckpt")
        m = store.last_good()
        if m is None:
            return []
        v = []
        for r in range(self.sc.world):
            try:
                store.load(r)
            except CorruptCheckpoint as exc:
                v.append(f"the last good checkpoint is broken: {exc}")
        if (m.group, m.name) not in published and not self.sc.ckpt_crash:
            v.append(f"the last good checkpoint names job {m.name} of {m.group}, which was not published")
        return v

    def _check_recovery(self) -> list[str]:
        """A healthy group is left alone; a fenced owner changes nothing;
        generations run with increasing tokens."""
        v = []
        for rec in self.recoveries:
            if rec["action"] == "none" and rec["changed"]:
                v.append(f"recovery ({rec['owner']}, t={rec['t']:.3f}) found the group healthy yet changed its state")
            if rec["action"] == "restarted" and rec["healthy"] and rec["owner"] == "A" and rec["stalled"] is None:
                v.append(f"recovery ({rec['owner']}, t={rec['t']:.3f}) restarted a healthy group")
        live = [g for g in self.gens if not g.refused]
        tokens = [g.token for g in sorted(live, key=lambda g: g.number)]
        if tokens != sorted(set(tokens)):
            v.append(f"generations ran with tokens {tokens}, not strictly increasing")
        return v

    def coverage(self) -> collections.Counter:
        """What this run exercised: injected faults, kills that fired (and on
        which side), job outcomes by boundary kind, notable phases, recovery
        actions. Sweeps add these up to show every case was reached."""
        c: collections.Counter = collections.Counter()
        sc = self.sc
        for name in FAULTS:
            if getattr(sc, name) is not None:
                c[f"fault:{name}"] += 1
        if sc.store_err_p:
            c["fault:store_errors"] += 1
        if sc.store_slow_p:
            c["fault:store_timeouts"] += 1
        for fired in self.fired:
            kind, what = fired.split(":")
            rank = sc.ckpt_crash[0] if kind == "ckpt_crash" else sc.death["rank"]
            c[f"{kind}:{'head' if rank == 0 else 'worker'}:{what}"] += 1
        for g in self.gens:
            receipts, phases = self._records(g)
            for rs in receipts.values():
                for x in rs:
                    c[f"outcome:{x['outcome']}:{boundary_kind_of(x)}"] += 1
            for ps in phases.values():
                for p in ps:
                    if p["phase"] in COVERED_PHASES:
                        c[f"phase:{p['phase']}"] += 1
        for rec in self.recoveries:
            c[f"recovery:{rec['action']}"] += 1
        return c

    def digest(self) -> str:
        """A digest of everything observable: equal digests mean equal runs."""
        h = hashlib.sha256()
        for path in sorted(self.fs.files):
            h.update(path.encode() + b"\0" + self.fs.files[path] + b"\0")
        for gen in self.gens:
            h.update(repr(sorted(gen.coll.items())).encode())
            h.update(repr(sorted(gen.store.data.items())).encode())
        return h.hexdigest()
