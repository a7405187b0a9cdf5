"""prepare: GSM8K (validated, converted, train/val/test) + the arithmetic curriculum + the tokenizer.

Writes `data/` as one unit (built beside it, then swapped in: a killed run leaves the old folder
whole, never new splits beside an old stats.json; same inputs and seed -> byte-identical files):
  gsm8k_train.jsonl  gsm8k_val.jsonl  gsm8k_test.jsonl  arith_train.jsonl  arith_eval.jsonl
  tokenizer.json     stats.json
  tasks/index.json   tasks/<task>_{train,val,test}.jsonl   (countdown where a stage uses it, and each task of
                     `tasks`: pipeline/data/tasks.py)
Rows follow the schema of docs/architecture.md. `val_size` GSM8K train rows are held out (seeded)
for validation; the test split is only read by the final evaluation. The tokenizer is trained on the
prompts and SFT responses of the training rows only (GSM8K train after the hold-out, arithmetic stream).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
from pathlib import Path
from typing import Any

from pipeline.core.config import DATA_DIR, Config
from pipeline.core.errors import InputError
from pipeline.core.files import replaced_dir, write_bytes_atomic, write_json_atomic
from pipeline.data.arithmetic import generate_curriculum
from pipeline.data.gsm8k import BadRow, load_raw, validate_split
from pipeline.data.prompts import response_text
from pipeline.data.tasks import TASK_DIR, extra_tasks, task_files, used_tasks
from pipeline.data.tokenizer import TOKENIZER_FILE, train_tokenizer
from pipeline.tracking import stage_logger

log = logging.getLogger(__name__)

SPLIT_FILES = ("gsm8k_train", "gsm8k_val", "gsm8k_test", "arith_train", "arith_eval")
MAX_LISTED_BAD = 50  # rejected rows listed one by one in stats.json (all are counted)


def check_disjoint(train: list[dict], test: list[dict], source: str) -> None:
    """InputError where a test question is also a train question (case and spacing aside): the model
    would be scored on problems it trained on. GSM8K's own splits share none."""
    def key(q: str) -> str:
        return " ".join(q.lower().split())

    seen = {key(r["question"]): r["id"] for r in train}
    both = [(r["id"], seen[key(r["question"])]) for r in test if key(r["question"]) in seen]
    if both:
        raise InputError(f"{source}: {len(both)} test question{'s are' if len(both) > 1 else ' is'} also in the train "
                         f"split (first: {both[0][0]} is {both[0][1]}); a model would be scored on problems it trained "
                         "on: remove them from the train file")


def split_validation(rows: list[dict], val_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, val): `val_size` rows drawn with `seed`; both keep the source order."""
    if val_size >= len(rows):
        raise InputError(f"data.val_size = {val_size} leaves no training rows "
                         f"(GSM8K train has {len(rows)} valid rows)")
    order = list(range(len(rows)))
    random.Random(f"gsm8k-val-{seed}").shuffle(order)
    held = set(order[:val_size])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    # ASCII-escaped JSON: a U+2028 in a question cannot break a reader that splits on line breaks
    text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in rows)
    return write_bytes_atomic(path, text.encode("utf-8"))


def _length_stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "mean": 0.0, "p95": 0, "max": 0}
    ordered = sorted(values)
    return {"min": ordered[0], "mean": round(statistics.fmean(ordered), 2),
            "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], "max": ordered[-1]}


def token_stats(tok, rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Prompt, response (SFT target + eos) and total token lengths of one file's rows."""
    prompts = [len(ids) for ids in tok.encode_batch([r["prompt"] for r in rows])]
    responses = [len(ids) + 1 for ids in tok.encode_batch([response_text(r["solution"]) for r in rows])]
    return {"prompt": _length_stats(prompts), "response": _length_stats(responses),
            "total": _length_stats([p + q for p, q in zip(prompts, responses)])}


def _report_bad(bad: list[BadRow]) -> None:
    for b in bad[:10]:
        log.warning("rejected GSM8K %s row %s: %s", b.split, b.location, b.reason)
    if len(bad) > 10:
        log.warning("... and %d more rejected rows (listed in %s/stats.json)", len(bad) - 10, DATA_DIR)


def run_prepare(cfg: Config) -> dict[str, Any]:
    """The prepare stage, as one MLflow stage run (row counts, rejections and token lengths as
    metrics, data/stats.json as an artifact) when tracking is on."""
    with stage_logger(cfg, "prepare") as tracker:  # fails fast, before any work, if MLflow is down
        result, stats = _prepare(cfg)
        metrics = {f"data/{name}_rows": float(n) for name, n in stats["counts"].items()}
        metrics["data/rejected_rows"] = float(result["rejected"])
        metrics["data/vocab_size"] = float(stats["vocab_size"])
        for name, parts in stats["token_lengths"].items():  # e.g. data/arith_train_response_max_tokens
            for part in ("prompt", "response"):
                metrics.update({f"data/{name}_{part}_{k}_tokens": float(parts[part][k]) for k in ("mean", "max")})
        tracker.log_metrics(metrics, step=0)
        tracker.log_artifact(result["outputs"]["stats"])
    return result


def _prepare(cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the stage's result, the stats written to data/stats.json)."""
    d = cfg.data
    out = Path(DATA_DIR)
    raw = load_raw(d.gsm8k_source, d.gsm8k_config)
    gsm_train, bad_train = validate_split(raw["train"], "train", d.prompt_template, d.max_bad_fraction,
                                          d.gsm8k_source)
    gsm_test, bad_test = validate_split(raw["test"], "test", d.prompt_template, d.max_bad_fraction,
                                        d.gsm8k_source)
    bad = bad_train + bad_test
    _report_bad(bad)
    check_disjoint(gsm_train, gsm_test, d.gsm8k_source)
    gsm_train, gsm_val = split_validation(gsm_train, d.val_size, d.seed)
    arith_train, arith_eval = generate_curriculum(d.arith_train_size, d.arith_eval_size, d.arith_max_level,
                                                  d.seed, d.prompt_template, d.arith_solution)
    splits = {"gsm8k_train": gsm_train, "gsm8k_val": gsm_val, "gsm8k_test": gsm_test,
              "arith_train": arith_train, "arith_eval": arith_eval}
    for task, parts in extra_tasks(cfg).items():  # countdown where a stage uses it, and the tasks of `tasks`
        check_disjoint(parts["train"] + parts["val"], parts["test"], f"tasks.{task}.source")
        files = task_files(task)
        splits.update({files.train[:-6]: parts["train"], files.val[:-6]: parts["val"], files.test[:-6]: parts["test"]})

    tok = _tokenizer(cfg, gsm_train + arith_train)
    if d.chat_template:  # every task's prompt, evaluation's included: the same template
        _render_chat(splits, tok, cfg)

    stats = _stats(d, raw, splits, bad_train, bad_test, tok)
    with replaced_dir(out) as tmp:  # all of data/ appears at once, or the old one stays
        (tmp / TASK_DIR).mkdir()
        write_json_atomic(tmp / TASK_DIR / "index.json", {t: vars(task_files(t)) for t in used_tasks(cfg)})
        for name, rows in splits.items():
            write_jsonl(tmp / f"{name}.jsonl", rows)
        if cfg.model.backend == "gpt":
            tok.save(tmp)
        else:
            _save_hf_tokenizer_json(tok, tmp)
        write_json_atomic(tmp / "stats.json", stats)
    paths = {name.replace("/", "_"): str(out / f"{name}.jsonl") for name in splits}
    paths["tokenizer"], paths["stats"] = str(out / TOKENIZER_FILE), str(out / "stats.json")
    return {"outputs": paths, "counts": stats["counts"], "rejected": len(bad)}, stats


def _stats(d, raw, splits, bad_train: list[BadRow], bad_test: list[BadRow], tok) -> dict[str, Any]:
    """The content of data/stats.json."""
    bad = bad_train + bad_test
    arith_train = splits["arith_train"]
    return {
        "source": d.gsm8k_source,
        "counts": {name.replace("/", "_"): len(rows) for name, rows in splits.items()},
        "gsm8k_rows_read": {"train": len(raw["train"]), "test": len(raw["test"])},
        "rejected": {"train": len(bad_train), "test": len(bad_test),
                     "rows": [vars(b) for b in bad[:MAX_LISTED_BAD]]},
        "arith_levels": {str(lv): sum(r["level"] == lv for r in arith_train)
                         for lv in range(1, d.arith_max_level + 1)},
        "vocab_size": tok.vocab_size,
        "token_lengths": {name.replace("/", "_"): token_stats(tok, rows) for name, rows in splits.items()},
    }


def _tokenizer(cfg: Config, train_rows: list[dict[str, Any]]):
    """The gpt backend's byte-level BPE, trained here; the hf backend's own tokenizer (no BPE trained)."""
    if cfg.model.backend == "hf":
        from pipeline.data.tokenizer import load_hf_tokenizer

        try:
            return load_hf_tokenizer(cfg.model.init)
        except (OSError, ValueError) as exc:
            raise InputError(f"model.init = {cfg.model.init!r}: cannot load its tokenizer "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    init = Path(cfg.model.init) if cfg.model.init else None  # a pipeline checkpoint holds both files
    if init is not None and (init / "config.json").is_file() and not (init / "manifest.json").is_file():
        raise InputError(f"model.init = {cfg.model.init!r} is a Hugging Face model folder (config.json, no "
                         f"manifest.json), but model.backend = gpt starts from a pipeline checkpoint; set model.backend=hf to "
                         f"train that model (its own tokenizer is then used, no BPE is trained)")
    # Prompt and response are separate texts, as they are tokenized separately (no merge across them).
    corpus = [t for r in train_rows for t in (r["prompt"], response_text(r["solution"]))]
    return train_tokenizer(corpus, cfg.data.vocab_size)


def _render_chat(splits: dict[str, list[dict[str, Any]]], tok, cfg: Config) -> None:
    """Each row's prompt (the filled template: question + answer-format instruction) becomes the user
    turn of the tokenizer's chat template, after `data.system_prompt`."""
    try:
        for rows in splits.values():
            for r in rows:
                r["prompt"] = tok.chat_prompt(r["prompt"], cfg.data.system_prompt)
    except ValueError as exc:
        raise InputError(f"data.chat_template = true but {exc} (model.init = {cfg.model.init!r}); "
                         f"set data.chat_template: false") from None


def _save_hf_tokenizer_json(tok, out: Path) -> Path:
    """data/tokenizer.json for the hf backend: the model tokenizer's own serialisation (for the record)."""
    text = tok.to_str() or json.dumps({"hf_tokenizer": getattr(tok.hf, "name_or_path", "")})
    return write_bytes_atomic(out / TOKENIZER_FILE, text.encode("utf-8"))
