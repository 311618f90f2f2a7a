"""Our FSM compiler (sgjax.fsm) against xgrammar, outlines-core and llguidance on the SmolLM2 vocabulary.

Per library and grammar: cold compile time (per-tokenizer preprocessing reported separately), the per-token
cost of a full-vocabulary mask plus advance along a valid token walk (mean / p99 microseconds), memory of the
compiled structure where the library reports it, and how often the peer's allowed set equals ours at each
step of the walk (against sgjax with and without the canonical forced-token rule, docs/fsm.md).

    .venv/bin/python scripts/perf/bench_fsm_peers.py [--out /tmp/bench_fsm_peers.jsonl] [--walk-repeats 20]

Peers are optional (pip install xgrammar outlines-core llguidance); a missing one is skipped. The CPU may be
shared, so every timing is repeated (--repeats, --compile-repeats, --walk-repeats) and the median is reported.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

import numpy as np
from fsm_peers import LLGuidance, Ours, Outlines, OutlinesIndex, XGrammar
from fsm_workloads import REGEXES, SCHEMAS

EOS_TOKEN = "<|im_end|>"

# Explicit ASCII classes everywhere: \d \w \s differ between the libraries' regex dialects (ASCII vs Unicode).


def _median(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def _timed(fn, repeats: int):
    """(median seconds, all runs, last result)."""
    runs, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t0)
    return _median(runs), runs, out


def versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    for pkg in ("sgjax", "numpy", "tokenizers", "transformers", "torch", "xgrammar", "llguidance", "outlines-core"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["sgjax_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
            or None
        )
    except OSError:
        out["sgjax_commit"] = None
    return out


def unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32[W] bitmask (bit t%32 of word t//32) -> bool[V]."""
    return np.unpackbits(np.ascontiguousarray(words, dtype=np.int32).view(np.uint8), bitorder="little")[
        :vocab_size
    ].astype(bool)


# ----------------------------------------------------------------------------------------------------------------


def walk_masks(adapter, handle, walk, words):
    """Replay `walk` on a fresh session: (int32[steps, W] masks before each token, index of the first rejected
    token or None). Only steps before the rejection are recorded."""
    s = adapter.session(handle)
    out = np.zeros((len(walk), words), np.int32)
    for i, t in enumerate(walk):
        s.mask(out[i])
        if not s.advance(int(t)):
            return out[: i + 1], i
    return out, None


def check_walk(adapters, handles, walk, vocab_size, words):
    """Names of the adapters that reject `walk` (a token outside the mask or a failed advance)."""
    rejected = {}
    for a in adapters:
        masks, bad = walk_masks(a, handles[a.name], walk, words)
        if bad is None:
            allowed = np.array([unpack(masks[i], vocab_size)[t] for i, t in enumerate(walk)])
            bad = int(np.argmin(allowed)) if not allowed.all() else None
        if bad is not None:
            rejected[a.name] = bad
    return rejected


def guided_walk(adapters, handles, example: bytes, vocab, eos_id, vocab_size, words, seed=0, max_steps=200):
    """Fallback walk when a library rejects the tokenized example: at each step take the argmax of a fixed-seed
    random score vector over the tokens every library in `adapters` allows, with a large bonus for tokens that
    spell a prefix of the rest of the example (longest first) and a smaller one for EOS, so the walk follows
    the example wherever the libraries let it and ends as soon as it can once it has left it.
    Returns (walk, ended_with_eos)."""
    rng = np.random.default_rng(seed)
    sessions = [a.session(handles[a.name]) for a in adapters]
    buf = np.zeros(words, np.int32)
    walk, rest = [], example
    lens = np.array([len(t) if t else 0 for t in vocab.tokens], np.float64)
    for _ in range(max_steps):
        allowed = np.ones(vocab_size, bool)
        for s in sessions:
            s.mask(buf)
            allowed &= unpack(buf, vocab_size)
        if not allowed.any():
            return walk, False
        score = rng.normal(size=vocab_size)
        if rest:
            prefix = np.array([bool(t) and rest.startswith(t) for t in vocab.tokens])
            score += prefix * (1000.0 + 10.0 * lens)
        score[eos_id] += 500.0
        t = int(np.argmax(np.where(allowed, score, -np.inf)))
        walk.append(t)
        if t == eos_id:
            return walk, True
        tb = vocab.tokens[t]
        rest = rest[len(tb) :] if rest.startswith(tb) else b""
        for s in sessions:
            s.advance(t)
    return walk, False


def time_walk(adapter, handle, walk, words, repeats):
    """Per-token mask and advance times (ns) over `repeats` fresh sessions; each repeat's stats, then medians."""
    buf = np.zeros(words, np.int32)
    per_rep = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        s = adapter.session(handle)
        mask_ns = np.zeros(len(walk), np.int64)
        adv_ns = np.zeros(len(walk), np.int64)
        gc.disable()  # no gc.collect() here: it evicts the caches and inflates the first steps (~40 us)
        try:
            for i, t in enumerate(walk):
                t0 = clock()
                s.mask(buf)
                t1 = clock()
                ok = s.advance(t)
                t2 = clock()
                mask_ns[i], adv_ns[i] = t1 - t0, t2 - t1
                if not ok:
                    raise RuntimeError(f"{adapter.name} rejected token {t} at step {i} while timing")
        finally:
            gc.enable()
        tot = (mask_ns + adv_ns) / 1e3
        per_rep.append(
            {
                "mean": tot.mean(),
                "p99": np.percentile(tot, 99),
                "max": tot.max(),
                "mask_mean": mask_ns.mean() / 1e3,
                "advance_mean": adv_ns.mean() / 1e3,
                "first": tot[0],
            }
        )
    med = {k: _median([r[k] for r in per_rep]) for k in per_rep[0]}
    return {
        "mask_us_mean": med["mean"],
        "mask_us_p99": med["p99"],
        "mask_us_max": med["max"],
        "mask_only_us_mean": med["mask_mean"],
        "advance_us_mean": med["advance_mean"],
        "first_step_us": med["first"],
        "mask_us_mean_runs": [round(r["mean"], 3) for r in per_rep],
    }


class Oracle:
    """Python `regex` partial full-match on our grammar's regex (for a schema: schema_to_regex's output): is
    prefix + token still the beginning of a match? An independent check of our byte DFA and token tables."""

    def __init__(self, pattern: str):
        import regex

        body = pattern[1:] if pattern.startswith("^") else pattern
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        self.rx = regex.compile(body, regex.ASCII)

    def viable(self, prefix: bytes, token: bytes | None, is_eos: bool):
        """True/False, or None where it cannot say (special tokens, text that is not whole UTF-8)."""
        try:
            if is_eos:
                return self.rx.fullmatch(prefix.decode()) is not None
            if token is None:
                return None
            return self.rx.fullmatch((prefix + token).decode(), partial=True) is not None
        except UnicodeDecodeError:
            return None


def agreement(
    ours_masks,
    peer_masks,
    walk,
    vocab,
    eos_id,
    canonical_rows=None,
    plain_masks=None,
    oracle=None,
    max_examples=8,
    oracle_sample=48,
):
    """Compare allowed sets step by step along `walk` (ours_masks[i] / peer_masks[i]: before walk[i]).

    identical_frac: steps with identical sets; symdiff_*: size of the symmetric difference where they differ;
    identical_frac_ignoring_specials: the same with the non-EOS special tokens left out (peers that treat
    `<|endoftext|>` etc. as text); explained_by_canonical: differing steps where sgjax-plain equals the peer;
    oracle_contradicts_ours: tokens on which the Python-regex oracle sides with the peer against us (a token we
    allow that cannot start a match, or one the peer allows that can, where our plain mask forbids it).
    Examples are distinct by the (only_ours, only_peer) token lists, with the text before the step."""
    V = vocab.size
    specials = np.array([t is None and i != eos_id for i, t in enumerate(vocab.tokens)])
    steps = min(len(ours_masks), len(peer_masks))
    sizes, seen, examples = [], {}, []
    ignoring_specials = canonical_explained = 0
    oracle_checked = oracle_contra = 0
    text = b""
    for i in range(steps):
        a, b = unpack(ours_masks[i], V), unpack(peer_masks[i], V)
        if not (a == b).all():
            only_ours, only_peer = np.flatnonzero(a & ~b), np.flatnonzero(b & ~a)
            sizes.append(len(only_ours) + len(only_peer))
            if ((a == b) | specials).all():
                ignoring_specials += 1
            plain = unpack(plain_masks[i], V) if plain_masks is not None else None
            if plain is not None and (plain == b).all():
                canonical_explained += 1
            contra = []
            if oracle is not None:
                ref = plain if plain is not None else a  # the oracle judges byte-valid masks, before canonical
                for ids, want in ((np.flatnonzero(ref & ~b), False), (np.flatnonzero(b & ~ref), True)):
                    for t in ids[:oracle_sample]:
                        v = oracle.viable(text, vocab.tokens[t], t == eos_id)
                        if v is None:
                            continue
                        oracle_checked += 1
                        if v == want:
                            oracle_contra += 1
                            contra.append(int(t))

            def show(ids):
                return [
                    vocab.tokens[t].decode("utf-8", "backslashreplace")
                    if vocab.tokens[t] is not None
                    else ("<eos>" if t == eos_id else f"<special {t}>")
                    for t in ids[:8]
                ]

            key = (tuple(show(only_ours)), tuple(show(only_peer)))
            if key in seen:
                seen[key]["count"] += 1
            elif len(examples) < max_examples:
                ex = {
                    "step": i,
                    "text_before": text[-48:].decode("utf-8", "backslashreplace"),
                    "next_token": show([walk[i]])[0],
                    "ours_allowed": int(a.sum()),
                    "peer_allowed": int(b.sum()),
                    "only_ours": len(only_ours),
                    "only_peer": len(only_peer),
                    "only_ours_tokens": list(key[0]),
                    "only_peer_tokens": list(key[1]),
                    "count": 1,
                }
                if canonical_rows is not None:
                    ex["canonical_forced"] = bool(canonical_rows[i])
                if contra:
                    ex["oracle_contradicts_ours_tokens"] = show(np.array(contra))
                seen[key] = ex
                examples.append(ex)
        tok = vocab.tokens[walk[i]] if i < len(walk) else None
        text += tok or b""
    return {
        "steps": steps,
        "identical_frac": (steps - len(sizes)) / max(steps, 1),
        "differing_steps": len(sizes),
        "symdiff_mean": float(np.mean(sizes)) if sizes else 0.0,
        "symdiff_max": int(max(sizes, default=0)),
        "identical_frac_ignoring_specials": (steps - len(sizes) + ignoring_specials) / max(steps, 1),
        "explained_by_canonical": canonical_explained if plain_masks is not None else None,
        "oracle_tokens_checked": oracle_checked,
        "oracle_contradicts_ours": oracle_contra,
        "examples": examples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/bench_fsm_peers.jsonl")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of tokenizer preparation")
    ap.add_argument("--compile-repeats", type=int, default=3, help="cold compiles per library and grammar")
    ap.add_argument("--walk-repeats", type=int, default=20, help="timed walks (fresh matcher each)")
    ap.add_argument("--xgrammar-threads", type=int, default=1, help="GrammarCompiler max_threads")
    ap.add_argument("--skip", nargs="*", default=[], help="libraries to leave out")
    args = ap.parse_args()

    from sgjax.fsm import from_tokenizer
    from sgjax.model.tokenizer import load_tokenizer

    vers = versions()
    load_start = os.getloadavg()
    common = {
        "versions": vers,
        "repeats": args.repeats,
        "compile_repeats": args.compile_repeats,
        "walk_repeats": args.walk_repeats,
        "xgrammar_threads": args.xgrammar_threads,
        "timing_note": (
            "CPU shared with other work: every timing repeated, the median over repeats reported "
            "(per walk: mean and p99 over its steps, then the median over walk_repeats walks); "
            "mask times are per token, mask + advance, fresh matcher/state per walk, gc off"
        ),
    }
    rows = []

    tok = load_tokenizer()
    V = tok.vocab_size
    words = (V + 31) // 32
    eos_id = tok.token_to_id(EOS_TOKEN)
    assert eos_id in tok.eos_token_ids, (eos_id, tok.eos_token_ids)

    def prep_row(lib, med, runs, **kw):
        rows.append(
            {
                "bench": "tokenizer_prep",
                "library": lib,
                "seconds_median": med,
                "seconds_runs": [round(r, 4) for r in runs],
                **kw,
                **common,
            }
        )

    def ours_vocab():
        v = from_tokenizer(tok)
        v.byte_matrix, v.sorted_index  # noqa: B018 - built lazily on first compile otherwise
        return v

    med, runs, vocab = _timed(ours_vocab, args.repeats)
    prep_row("sgjax", med, runs, what="from_tokenizer + byte_matrix + sorted_index")

    ours_adapters = [Ours(vocab, True), Ours(vocab, False)]
    adapters = list(ours_adapters)
    tmp = tempfile.mkdtemp(prefix="bench_fsm_peers_")
    tok_file = os.path.join(tmp, "tokenizer.json")
    tok.hf.save(tok_file)
    skipped = {}
    hf_tok = None
    if {"xgrammar", "llguidance"} - set(args.skip):
        import transformers

        med, runs, hf_tok = _timed(
            lambda: transformers.PreTrainedTokenizerFast(tokenizer_file=tok_file, eos_token=EOS_TOKEN), args.repeats
        )
        assert hf_tok.eos_token_id == eos_id and len(hf_tok) == V
        prep_row(
            "transformers", med, runs, what="PreTrainedTokenizerFast(tokenizer_file), shared by xgrammar and llguidance"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    for name, make, what in (
        (
            "xgrammar",
            lambda: XGrammar(hf_tok, V, eos_id, args.xgrammar_threads),
            "TokenizerInfo.from_huggingface + GrammarCompiler",
        ),
        ("llguidance", lambda: LLGuidance(hf_tok, V, eos_id), "llguidance.hf.from_tokenizer (LLTokenizer)"),
        ("outlines-core", lambda: Outlines(vocab, eos_id), "token bytes table + outlines_core.Vocabulary"),
    ):
        if name in args.skip:
            continue
        try:
            t0 = time.perf_counter()
            make()  # first construction includes the import
            import_s = time.perf_counter() - t0
            med, runs, a = _timed(make, args.repeats)
        except ImportError as e:
            skipped[name] = f"not installed: {e}"
            continue
        prep_row(name, med, runs, what=what, first_with_import_s=import_s)
        adapters.append(a)
        if name == "outlines-core" and "outlines-core/index" not in args.skip:
            b = OutlinesIndex.__new__(OutlinesIndex)
            b.__dict__.update(a.__dict__)
            adapters.append(b)
    for r in rows:
        r["skipped"] = skipped

    grammars = [("regex", n, r, ex) for n, (r, ex) in REGEXES.items()] + [
        ("json_schema", n, s, json.dumps(ex)) for n, (s, ex) in SCHEMAS.items()
    ]
    for kind, gname, spec, example in grammars:
        print(f"# {gname}", flush=True)
        gc.collect()
        handles, compile_info = {}, {}
        failed = {}
        for a in adapters:
            if a.name == "outlines-core/index":
                continue
            try:
                med, runs, h = _timed(lambda: a.compile(kind, spec), args.compile_repeats)
            except Exception as e:  # noqa: BLE001 - a peer that cannot compile a grammar is a result
                failed[a.name] = f"{type(e).__name__}: {e}"[:300]
                continue
            handles[a.name] = h
            compile_info[a.name] = (med, runs)
        if "outlines-core" in handles:
            handles["outlines-core/index"] = handles["outlines-core"]
            compile_info["outlines-core/index"] = compile_info["outlines-core"]
        live = [a for a in adapters if a.name in handles]
        maskers = [a for a in live if a.name != "outlines-core/index"]  # the Index API gives lists, not bitmasks

        ids = tok.encode(example, add_special_tokens=False)
        assert tok.decode(ids) == example
        tokenized = ids + [eos_id]
        rejected = check_walk(maskers, handles, tokenized, V, words)
        # One walk per library: the tokenized example where the library (and sgjax) accept it, else a guided
        # walk over the tokens that the library and both sgjax variants allow (all libraries if sgjax rejects).
        walks = {a.name: (tokenized, {"walk_source": "tokenized_example"}) for a in maskers}
        ours_names = [n for n in ("sgjax", "sgjax-plain") if n in handles]
        shared = bool(set(rejected) & set(ours_names))
        groups = (
            [maskers] if shared else [[a for a in maskers if a.name in ours_names or a.name == bad] for bad in rejected]
        )
        for group in groups:
            walk, ended = guided_walk(group, handles, example.encode(), vocab, eos_id, V, words)
            still = check_walk(group, handles, walk, V, words)
            assert not still, f"{gname}: the guided walk is rejected by {still}"
            info = {
                "walk_source": "guided_random_walk",
                "walk_ended_with_eos": ended,
                "walk_text": tok.decode([t for t in walk if t != eos_id]),
            }
            for a in group:
                if shared or a.name not in ours_names:
                    walks[a.name] = (walk, info)
        if "outlines-core" in walks:
            walks["outlines-core/index"] = walks["outlines-core"]
        oracle = Oracle(handles["sgjax"].regex) if "sgjax" in handles else None

        for a in live:
            walk, info = walks[a.name]
            info = {**info, "walk_tokens": len(walk), "rejected_tokenized_example": rejected}
            timing = time_walk(a, handles[a.name], walk, words, args.walk_repeats)
            med, runs = compile_info[a.name]
            agree = {}
            if a.name not in ("sgjax", "outlines-core/index") and "sgjax" in handles:
                peer = walk_masks(a, handles[a.name], walk, words)[0]
                ours = walk_masks(ours_adapters[0], handles["sgjax"], walk, words)[0]
                plain = walk_masks(ours_adapters[1], handles["sgjax-plain"], walk, words)[0]
                g, st, canon_rows = handles["sgjax"], 0, []
                for t in walk:
                    canon_rows.append(int(g.canonical[st]) >= 0)
                    st = g.next_state(st, t)
                agree["vs_sgjax"] = agreement(ours, peer, walk, vocab, eos_id, canon_rows, plain, oracle)
                if a.name != "sgjax-plain":
                    agree["vs_sgjax_plain"] = agreement(plain, peer, walk, vocab, eos_id, canon_rows, None, oracle)
            try:
                mem = a.memory(handles[a.name])
            except Exception as e:  # noqa: BLE001
                mem = {"memory_error": str(e)[:200]}
            row = {
                "bench": "grammar",
                "library": a.name,
                "grammar": gname,
                "kind": kind,
                "compile_ms_median": med * 1e3,
                "compile_ms_runs": [round(r * 1e3, 3) for r in runs],
                **timing,
                **mem,
                **info,
                "agreement": agree,
                "compile_failed": failed,
                **common,
            }
            if a.name in ("sgjax", "sgjax-plain"):
                row["regex_chars"] = len(handles[a.name].regex)
            rows.append(row)
            print(
                f"  {a.name:20s} compile {med * 1e3:9.2f} ms  mask {timing['mask_us_mean']:8.2f} / "
                f"{timing['mask_us_p99']:8.2f} us  walk {len(walk)} ({info['walk_source']})",
                flush=True,
            )
        for name, err in failed.items():
            rows.append({"bench": "grammar", "library": name, "grammar": gname, "kind": kind, "error": err, **common})

    load_end = os.getloadavg()
    for r in rows:
        r["loadavg_start_end"] = [round(load_start[0], 2), round(load_end[0], 2)]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print_table(rows)
    print(f"wrote {len(rows)} rows to {args.out}")


def print_table(rows):
    print("\ntokenizer preprocessing (s, median)")
    for r in rows:
        if r["bench"] == "tokenizer_prep":
            print(f"  {r['library']:20s} {r['seconds_median']:.3f}  ({r['what']})")
    head = (
        f"{'library':20s} {'grammar':13s} {'compile ms':>10s} {'1st mask us':>11s} {'mask us mean':>12s} "
        f"{'p99':>8s} {'mem KB':>7s} {'agree vs sgjax':>14s} {'vs plain':>9s} {'no-spec':>7s}  walk"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if r["bench"] != "grammar":
            continue
        if "error" in r:
            print(f"{r['library']:20s} {r['grammar']:13s} FAILED: {r['error'][:80]}")
            continue

        def frac(k, field="identical_frac", sym=True):
            a = r["agreement"].get(k)
            if not a:
                return "-"
            s = f"{a[field] * 100:.0f}%"
            return s + (f" d{a['symdiff_max']}" if sym and a["differing_steps"] else "")

        mem = f"{r['memory_bytes'] / 1024:.0f}" if "memory_bytes" in r else "-"
        print(
            f"{r['library']:20s} {r['grammar']:13s} {r['compile_ms_median']:10.2f} {r['first_step_us']:11.1f} "
            f"{r['mask_us_mean']:12.2f} {r['mask_us_p99']:8.2f} {mem:>7s} {frac('vs_sgjax'):>14s} "
            f"{frac('vs_sgjax_plain'):>9s} {frac('vs_sgjax_plain', 'identical_frac_ignoring_specials', False):>7s}"
            f"  {r['walk_tokens']} tok, {r['walk_source'].split('_')[0]}"
        )
    print(
        "agree: steps of the walk with identical allowed sets (dN: largest symmetric difference); no-spec: vs plain,"
        " ignoring non-EOS special tokens"
    )


if __name__ == "__main__":
    main()
