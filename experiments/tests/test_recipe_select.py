"""experiments/recipe_select.py: the validation draw never touches the held-out set, the table by hand,
and a run of its CLI over tiny checkpoints asked exactly as the evaluate stage asks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import recipe_select as rs
from pipeline.data.arithmetic import PHRASINGS, generate_curriculum, sample_problem, to_row

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A tiny Llama from a config, saved with a chat template (tests/conftest.py's builder)."""
    from pipeline.data.tokenizer import train_tokenizer
    from tests.conftest import CHAT_TEMPLATE, arithmetic_texts, save_tiny_hf

    tokenizer = train_tokenizer(arithmetic_texts(), vocab_size=320)
    return save_tiny_hf(tmp_path_factory.mktemp("llama") / "m", "llama", tokenizer, CHAT_TEMPLATE, max_positions=512)


TEMPLATE = "{question}\nGive the final answer as <answer>N</answer>."


@settings(max_examples=200, deadline=None)
@given(level=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_expression_reads_back_every_phrasing(level, seed):
    rng = random.Random(seed)
    p = sample_problem(level, rng)
    for phrasing in PHRASINGS:
        assert rs.expression(phrasing.format(e=p.expr)) == p.expr
    assert rs.expression(to_row(p, "x", rng, TEMPLATE)["question"]) == p.expr


def test_expression_refuses_a_question_of_another_shape():
    with pytest.raises(ValueError, match="not a curriculum question"):
        rs.expression("Natalia sold clips to 48 of her friends. How many?")


def test_validation_is_disjoint_from_the_held_out_set_distinct_and_seeded():
    _, held = generate_curriculum(200, 300, 3, 0, TEMPLATE, "lines")
    rows = rs.validation_rows(held, 300, 3, 1, TEMPLATE, "lines")
    held_exprs = {rs.expression(r["question"]) for r in held}
    exprs = [rs.expression(r["question"]) for r in rows]
    assert not held_exprs & set(exprs) and len(set(exprs)) == len(exprs)
    per_level = {lv: sum(r["level"] == lv for r in rows) for lv in (1, 2, 3)}
    # level 1 has 155 distinct expressions; the held-out set takes 100, so 55 are left
    assert per_level == {1: 55, 2: 100, 3: 100}
    assert all(r["prompt"] == r["question"] + "\nGive the final answer as <answer>N</answer>." for r in rows)
    assert rs.validation_rows(held, 300, 3, 1, TEMPLATE, "lines") == rows
    assert rs.validation_rows(held, 300, 3, 2, TEMPLATE, "lines") != rows


def test_validation_leaves_out_the_training_stream_and_a_level_it_exhausts():
    train, held = generate_curriculum(3000, 300, 3, 0, TEMPLATE, "lines")
    rows = rs.validation_rows(held + train, 300, 3, 1, TEMPLATE, "lines")
    seen = {rs.expression(r["question"]) for r in held + train}
    assert not seen & {rs.expression(r["question"]) for r in rows}
    # the stream's 1,000 level-1 rows hold the 55 level-1 expressions the held-out set leaves
    assert {lv: sum(r["level"] == lv for r in rows) for lv in (1, 2, 3)} == {1: 0, 2: 100, 3: 100}


def test_table_hand_computed():
    rows = [{"level": lv} for lv in (1, 1, 2, 2)]
    scored = {"ref": [{"correct": c, "well_formed": w} for c, w in ((1, 1), (0, 0), (0, 1), (0, 1))],
              "new": [{"correct": c, "well_formed": 1} for c in (1, 1, 1, 0)]}
    t = rs.table(rows, scored, draws=500)
    assert t["problems"] == {"all": 4, "level1": 2, "level2": 2}
    assert t["entries"]["ref"] == {"all": 25.0, "level1": 50.0, "level2": 0.0, "well_formed": 75.0}
    vs = t["entries"]["new"]["vs_ref"]
    assert (vs["all"]["diff"], vs["all"]["only_a"], vs["all"]["only_b"]) == (50.0, 2, 0)
    assert (vs["level1"]["diff"], vs["level2"]["diff"]) == (50.0, 50.0)
    assert "| new | 75.0% | 100.0% | 50.0% | 100.0% | +50.0 [" in rs.markdown(t)


def _recipe_folder(tmp_path, model: str) -> None:
    """params.yaml and data/ as the prepare stage writes them (its own chat rendering)."""
    from pipeline.core.config_loading import load_config
    from pipeline.data.tokenizer import load_hf_tokenizer
    from pipeline.stages.prepare import _render_chat

    params = {"data": {"chat_template": True, "arith_max_level": 2, "arith_solution": "lines",
                       "prompt_template": TEMPLATE},
              "model": {"backend": "hf", "init": model, "num_threads": 1},
              "evaluate": {"max_new_tokens": 3, "batch_size": 8}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    train, held = generate_curriculum(50, 20, 2, 0, TEMPLATE, "lines")
    splits = {"arith_train": train, "arith_eval": held}
    _render_chat(splits, load_hf_tokenizer(model), load_config(tmp_path / "params.yaml"))
    (tmp_path / "data").mkdir()
    for name, rows in splits.items():
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _asked(tmp_path, model: str, monkeypatch) -> tuple[list[list[dict]], Path]:
    """A recipe folder, and the list that collects the rows `evaluate_task` is asked (the evaluate stage's
    own function still scores them); with the path for the CLI's --out."""
    from pipeline.stages import evaluate

    _recipe_folder(tmp_path, model)
    asked: list[list[dict]] = []
    real = evaluate.evaluate_task
    monkeypatch.setattr(evaluate, "evaluate_task", lambda policy, rows, *a, **k: asked.append(rows) or real(
        policy, rows, *a, **k))
    return asked, tmp_path / "select.json"


def test_cli_scores_checkpoints_on_prompts_rendered_as_the_prepare_stage_renders(tmp_path, model, capsys, monkeypatch):
    asked, out = _asked(tmp_path, model, monkeypatch)
    assert rs.main([str(tmp_path), f"a={model}", f"b={model}", "--size", "12", "--draws", "100",
                    "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["problems"] == {"all": 12, "level1": 6, "level2": 6}
    same = result["entries"]["b"]["vs_a"]["all"]
    assert (same["diff"], same["only_a"], same["only_b"]) == (0.0, 0, 0)  # one model, greedy: the same answers
    written = json.loads(out.read_text())
    assert written["seed"] == 1 and len(written["rows"]) == 12
    assert [p["id"] for p in written["predictions"]["a"]] == [r["id"] for r in written["rows"]]
    # each checkpoint was asked the validation rows as prepare renders a row: the chat template's user turn
    from pipeline.core.config_loading import load_config
    from pipeline.data.tokenizer import load_hf_tokenizer
    from pipeline.stages.prepare import _render_chat

    expected = {"v": [dict(r) for r in written["rows"]]}
    _render_chat(expected, load_hf_tokenizer(model), load_config(tmp_path / "params.yaml"))
    want = [r["prompt"] for r in expected["v"]]
    assert len(asked) == 2 and all([r["prompt"] for r in rows] == want for rows in asked)
    assert all(r["prompt"] != w["prompt"] for r, w in zip(asked[0], written["rows"]))


def test_cli_fewshot_asks_after_the_first_worked_examples_of_the_training_stream(tmp_path, model, capsys,
                                                                               monkeypatch):
    """--fewshot 2: every question after the training stream's first two rows as earlier chat turns, as the
    evaluate stage's few-shot entries ask; the examples' solutions are in the prompt, the question last."""
    from pipeline.core.config_loading import load_config
    from pipeline.data.tokenizer import load_hf_tokenizer
    asked, out = _asked(tmp_path, model, monkeypatch)
    assert rs.main([str(tmp_path), f"a={model}", "--size", "6", "--fewshot", "2", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    train = [json.loads(line) for line in (tmp_path / "data" / "arith_train.jsonl").read_text().splitlines()]
    tokenizer, data = load_hf_tokenizer(model), load_config(tmp_path / "params.yaml").data
    (rows,) = asked
    assert written["fewshot"] == 2 and len(rows) == 6
    for row, val in zip(rows, written["rows"]):
        user = lambda q: TEMPLATE.format(question=q)  # noqa: E731
        turns = [(user(t["question"]), t["solution"]) for t in train[:2]]
        assert row["prompt"] == tokenizer.chat_prompt(user(val["question"]), data.system_prompt, turns)
        assert train[0]["solution"] in row["prompt"] and train[1]["solution"] in row["prompt"]
        assert train[2]["solution"] not in row["prompt"]
        assert row["prompt"].rindex(val["question"]) > row["prompt"].rindex(train[1]["solution"])


def test_cli_stops_when_the_held_out_prompts_were_prepared_otherwise(tmp_path, model):
    _recipe_folder(tmp_path, model)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["data"]["chat_template"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit, match="prepared under other params"):
        rs.main([str(tmp_path), f"a={model}", "--size", "4"])


@pytest.mark.parametrize("args, message", [
    (["noequals"], "NAME=FOLDER"), (["a="], "NAME=FOLDER"), (["=x"], "NAME=FOLDER"),
    (["a=.", "a=."], "distinct names"), (["a=/no/such/checkpoint"], "no checkpoint folder at /no/such/checkpoint"),
    (["a=.", "--fewshot", "-1"], "--fewshot is a number of worked examples, 0 or more")])
def test_cli_refuses_bad_checkpoint_arguments_before_scoring(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        rs.main([str(tmp_path), *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
