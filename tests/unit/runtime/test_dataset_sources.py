"""`datasets` directories and Arrow files as data sources, with a column mapping and chat-format (`messages`) rows:
read and checked at compile (a bad directory, split, column or type is a named problem), rows rendered with the
chat template (no Ray: the readers and the prompt formatting alone)."""

from __future__ import annotations

import pyarrow as pa
import pytest

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from rlflow.compiler import check_pipeline, compile_pipeline
from rlflow.data_head import head_problem, head_rows
from rlflow.data_sources import read_table
from rlflow.errors import PipelineInvalid
from rlflow.prompt_rows import encode_prompt, prompt_text, row_problem_as, row_prompt_answer
from rlflow.runtime.evaluation import held_out_rows
from rlflow.runtime.prompt_source import PromptSource
from rlflow.stages.tiny_model import build_tiny_llama

QA = {"question": ["12+7=", "3+4=", "10+10="], "solution": ["19", "7", "20"]}
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="},
          {"role": "assistant", "content": "19"}],
         [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]]
CHATML = ("{% for m in messages %}{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


@pytest.fixture
def qa_dir(tmp_path):
    path = tmp_path / "qa"
    datasets.Dataset.from_dict(QA).save_to_disk(str(path))
    return path


@pytest.fixture
def splits_dir(tmp_path):
    path = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(QA),
                          "test": datasets.Dataset.from_dict({k: v[:1] for k, v in QA.items()})}).save_to_disk(str(path))
    return path


FIELDS = ("question", "solution")


def test_a_dataset_directory_is_read_with_its_column_mapping(qa_dir):
    assert read_table(qa_dir).to_pylist()[0] == {"question": "12+7=", "solution": "19"}
    assert head_problem(qa_dir, FIELDS) is None
    assert [where for where, _ in head_rows(qa_dir, FIELDS)] == [f"'{qa_dir}' row {i}" for i in (1, 2, 3)]
    message, rule, fix = head_problem(qa_dir, ("prompt", "answer"))
    assert rule == "bad-data" and "'prompt', 'answer'" in message and "question, solution" in message
    assert "prompt_field" in fix


def test_a_dataset_dict_needs_its_split(splits_dir):
    assert head_problem(splits_dir, FIELDS, split="train") is None
    assert len(read_table(splits_dir, "test")) == 1
    message, rule, fix = head_problem(splits_dir, FIELDS)
    assert rule == "bad-split" and "train" in message and "test" in fix
    assert head_problem(splits_dir, FIELDS, split="validation")[1] == "bad-split"


def test_a_bad_directory_or_column_type_is_named(tmp_path, qa_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    message, rule, fix = head_problem(empty, FIELDS)
    assert rule == "bad-dataset-dir" and "save_to_disk" in fix
    numbers = tmp_path / "numbers"
    datasets.Dataset.from_dict({"question": [1, 2], "solution": ["1", "2"]}).save_to_disk(str(numbers))
    message, rule, _ = head_problem(numbers, FIELDS)
    assert rule == "bad-column-type" and "'question' is int64" in message
    assert head_problem(qa_dir, FIELDS, split="train")[1] == "bad-split"  # one Dataset has no splits


def test_arrow_files_in_both_ipc_formats(tmp_path):
    table = pa.table(QA)
    for name, writer in (("file.arrow", pa.ipc.new_file), ("stream.arrow", pa.ipc.new_stream)):
        with pa.OSFile(str(tmp_path / name), "wb") as sink, writer(sink, table.schema) as w:
            w.write_table(table)
        assert read_table(tmp_path / name).equals(table)
        assert head_problem(tmp_path / name, FIELDS) is None
    (tmp_path / "junk.arrow").write_text("not arrow")
    assert head_problem(tmp_path / "junk.arrow", FIELDS)[1] == "bad-data"


def test_messages_rows_render_with_the_chat_template_and_the_last_assistant_message_is_the_answer():
    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_llama("arith", progress=lambda line: None))
    tok.chat_template = CHATML
    row = {"messages": CHATS[0]}
    assert row_problem_as(row, ("messages", "messages"), "row 1", "messages") is None
    prompt, answer = row_prompt_answer(row, ("messages", "messages"), "messages")
    assert answer == "19" and prompt == CHATS[0][:2] and prompt_text(prompt) == "12+7="
    ids = encode_prompt(tok, prompt, "messages", "ignored: the chat opens with its own system message")
    assert tok.decode(ids).endswith("user\n12+7=</s>\n<s>assistant\n") and "Be brief." in tok.decode(ids)
    with_system = tok.decode(encode_prompt(tok, CHATS[1][:1], "messages", "Answer with a number."))
    assert with_system.startswith("<s>system\nAnswer with a number.")
    # an answer column beside the chat: the whole chat is the prompt
    assert row_prompt_answer({"m": CHATS[1][:1], "a": "7"}, ("m", "a"), "messages") == (CHATS[1][:1], "7")


@pytest.mark.parametrize("messages, rule", [
    ("12+7=", "bad-messages"), ([], "bad-messages"), ([{"role": "robot", "content": "hi"}], "bad-messages"),
    ([{"role": "user", "content": "3+4="}], "missing-answer"),  # the answer is the last assistant message
    ([{"role": "assistant", "content": "7"}], "bad-messages"),  # nothing for the model to answer
])
def test_bad_chats_are_named(messages, rule):
    assert row_problem_as({"messages": messages}, ("messages", "messages"), "row 1", "messages")[1] == rule


def test_a_chat_dataset_directory_is_checked_as_messages(tmp_path):
    path = tmp_path / "chats"
    datasets.Dataset.from_dict({"messages": CHATS}).save_to_disk(str(path))
    assert head_problem(path, ("messages", "messages"), prompt_format="messages") is None
    assert head_problem(path, ("messages", "messages"))[1] == "bad-column-type"  # raw needs text
    rows = held_out_rows({"source": str(path), "holdout": None, "prompt_field": "messages", "answer_field": "messages",
                          "prompt_format": "messages"}, size=8, seed=0)
    assert [(r["prompt"], r["answer"]) for r in rows] == [(CHATS[0][:2], "19"), (CHATS[1][:1], "7")]


def test_prompt_source_reads_messages_rows(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_llama("arith", progress=lambda line: None))
    tok.chat_template = CHATML
    source = PromptSource({"main": {"source": "builtin:arith", "prompt_field": "messages", "answer_field": "messages",
                                    "prompt_format": "messages"}}, tok, max_new_tokens={"main": 8}, max_model_len=128,
                          seed=0, source="p.yaml")
    source.streams["main"].next_row = lambda: {"messages": CHATS[1]}
    p = source.next(["main"])
    assert (p.prompt, p.answer) == ("3+4=", "7") and p.prompt_ids == encode_prompt(tok, CHATS[1][:1], "messages")


def test_a_dataset_directory_streams_from_its_memory_map_in_a_windowed_shuffle(tmp_path, monkeypatch):
    """Rows come from the memory-mapped table in this process (never through Ray Data, so nothing goes to the object
    store), every row once per epoch, in a shuffle window that is the same for a seed and new each epoch."""
    from rlflow.runtime import prompt_source

    n = 40
    datasets.Dataset.from_dict({"q": [f"{i}+1=" for i in range(n)], "a": [str(i + 1) for i in range(n)]}) \
        .save_to_disk(str(tmp_path / "big"))
    monkeypatch.setattr(prompt_source, "SHUFFLE_WINDOW", 8)
    monkeypatch.setattr(prompt_source, "CACHE_ROWS", 0)  # re-read each epoch, as a large table is

    def through_ray_data(self):
        raise AssertionError("a table source went through Ray Data (from_arrow copies it into the object store)")

    monkeypatch.setattr(prompt_source._TaskRows, "_dataset", through_ray_data)

    def epochs(seed: int, count: int = 2) -> list[list[int]]:
        rows = PromptSource({"main": {"source": str(tmp_path / "big"), "prompt_field": "q", "answer_field": "a"}},
                            None, max_new_tokens={"main": 8}, max_model_len=64, seed=seed, source="p.yaml").streams["main"]
        return [[int(rows.next_row()["q"].split("+")[0]) for _ in range(n)] for _ in range(count)]

    first, second = epochs(seed=0)
    assert sorted(first) == sorted(second) == list(range(n))  # each epoch: every row once
    assert first != second and epochs(seed=0) == [first, second] and epochs(seed=1)[0] != first
    assert first[0] < 8 and all(row < i + 8 for i, row in enumerate(first))  # never further ahead than the window


# --------------------------------------------------------------------------- compile

PIPELINE = """
name: datasets-dir
model: {{path: "builtin:tiny-llama", max_model_len: 64}}
data: {data}
stages:
  rollout: {{kind: rollout, group_size: 2, max_new_tokens: 8}}
  score:   {{kind: reward, fn: exact_match}}
  buffer:  {{kind: buffer, batch_groups: 2}}
  train:   {{kind: train, steps: 1}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: one_step}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync}}}}
"""


def pipeline(tmp_path, data: str):
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(data=data))
    return path


def problems(path) -> dict[str, object]:
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    return {p.rule: p for p in e.value.problems}


def test_a_pipeline_on_a_dataset_dict_directory_compiles_with_its_split_and_mapping(tmp_path, splits_dir):
    data = f'{{source: "{splits_dir.name}", split: train, prompt_field: question, answer_field: solution}}'
    plan = compile_pipeline(pipeline(tmp_path, data))
    task = plan["tasks"]["main"]
    assert (task["source"], task["split"], task["prompt_field"], task["answer_field"]) == (
        str(splits_dir), "train", "question", "solution")
    found = problems(pipeline(tmp_path, f'{{source: "{splits_dir.name}", prompt_field: question, answer_field: solution}}'))
    assert found["bad-split"].loc == ("data", "source") and "train, test" in found["bad-split"].message
    found = problems(pipeline(tmp_path, f'{{source: "{splits_dir.name}", split: train}}'))
    assert "'question', 'solution'" not in found["bad-data"].message and "no column 'prompt', 'answer'" in found["bad-data"].message
    found = problems(pipeline(tmp_path, '{source: "builtin:arith", split: train}'))
    assert found["bad-split"].loc == ("data", "split")
    found = problems(pipeline(tmp_path, '{source: "no_such_dir"}'))
    assert "missing-file" in found
    found = problems(pipeline(tmp_path, f'{{source: "{splits_dir.name}", split: train, prompt_field: question, '
                                        'answer_field: solution, prompt_format: messages}'))
    assert found["no-chat-template"].loc == ("data", "prompt_format")
